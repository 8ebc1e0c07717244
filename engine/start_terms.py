"""The start-up model's terms: what each phase's seconds are made of (`PHASES`: coefficient x an input of the start,
engine/start_inputs.py), with each coefficient's shipped prior and spread, and the inputs as the terms read them
(`Inputs`). The fit and the prediction over them: engine/start_model.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

HIT, MISS = "hit", "miss"
GB = 1e9
# A phase the model has no terms for (a stage it does not know): its mean, from this prior.
FALLBACK_PRIOR_S = 0.05


@dataclass(frozen=True)
class Inputs:
    """What a term reads: the start's inputs (start_inputs.INPUT_NAMES) and its cache pattern."""

    values: Mapping[str, float]
    pattern: Mapping[str, str]

    def get(self, name: str, default: float = 0.0) -> float:
        return float(self.values.get(name, default))

    def hit(self, cache: str) -> float:
        return 1.0 if self.pattern.get(cache) == HIT else 0.0

    def miss(self, cache: str) -> float:
        """1 when the cache will miss, and when its state is unknown (the prediction is then an upper bound)."""
        state = self.pattern.get(cache)
        return 0.0 if state is None or state == HIT else 1.0

    # Derived sizes, per rank (each rank reads its share).
    @property
    def ranks(self) -> float:
        return max(1.0, self.get("ranks", 1.0))

    @property
    def weights_gb(self) -> float:
        return self.get("weights_bytes") / GB / self.ranks

    @property
    def convert_gb(self) -> float:
        """GB of the weights the run de-quantizes or re-quantizes (start_inputs convert_bytes) per rank."""
        return self.get("convert_bytes") / GB / self.ranks

    @property
    def cold_gb(self) -> float:
        """Bytes of the files to read that the page cache does not hold; half of them when residency is unknown."""
        read = self.get("read_bytes")
        resident = self.values.get("resident_bytes")
        cold = read / 2 if resident is None else max(0.0, read - float(resident))
        return cold / GB / self.ranks

    @property
    def slowdown(self) -> float:
        """How much slower CPU work runs than on an idle machine: the run queue per usable core (start_inputs cpu_load
        average over the cores, at the plan), at least 1; 1 when the start recorded none."""
        return max(1.0, self.get("cpu_load", 0.0))

    @property
    def probe(self) -> float:
        return max(0.1, self.get("probe_gbps", 20.0))

    @property
    def stream_s(self) -> float:
        """Seconds to stream the model's weights once at this machine's read probe."""
        return self.weights_gb / self.probe

    @property
    def entry_stream_s(self) -> float:
        return self.get("entry_bytes") / GB / self.ranks / self.probe


@dataclass(frozen=True)
class Term:
    """coefficient x value(inputs). `unit` and `what` phrase it in the basis: "2.1 s/GB x 0.80 GB not in the page
    cache". `cpu`: the term is CPU work (Python, compiling, fixed costs), so its value is multiplied by the CPU
    contention the start meets (Inputs.slowdown); the read terms are already in the read probe's time, which the
    same contention slows."""

    key: str
    prior: float
    sd: float
    value: Callable[[Inputs], float]
    unit: str
    what: Callable[[Inputs], str]
    cpu: bool = True

    def x(self, inputs: Inputs) -> float:
        """The term's input as the fit and the prediction use it (times the slowdown for CPU work)."""
        v = self.value(inputs)
        return v * inputs.slowdown if self.cpu and v else v


def _one(_: Inputs) -> float:
    return 1.0


def _const(key: str, prior: float, sd: float = 0.3, what: str = "fixed cost") -> Term:
    return Term(key, prior, sd, _one, "s", lambda _x: what)


def _compiled(x: Inputs) -> float:
    return x.get("compile")


def _streamed(x: Inputs, gb: float | None = None) -> str:
    """ "the probe's time to stream 1.117 GB (0.032 s at 35.0 GB/s)"."""
    gb = x.weights_gb if gb is None else gb
    return f"the probe's time to stream {gb:.3f} GB ({gb / x.probe:.4f} s at {x.probe:.1f} GB/s)"


def _layers(x: Inputs) -> str:
    return f"{x.get('layers'):.0f} layers"


def _per_layer(key: str, prior: float, sd: float, gate: Callable[[Inputs], float] = _one) -> Term:
    """Python work per decoder layer (building, switching, running each layer's modules)."""
    return Term(key, prior, sd, lambda x: gate(x) * x.get("layers"), "s/layer", _layers)


# The shipped prior: each coefficient fitted (start_model.fit) on a 2-core AMD EPYC's recorded starts of the default
# model (a 135M-parameter Q4_1 GGUF run in place: a cold start of ~55 s, most of it graph_compile, and a warm one),
# in an idle machine's seconds, with a spread wide enough for the fit on this machine's own starts to move them.
# One model's starts cannot tell a fixed or per-layer cost from a per-GB or per-token one; that split is taken
# from the same machine's cold and warm starts of the 1.5B Q4_K_M GGUF (reports/real/startup): where the 1.5B
# costs about what the 135M does (model_init, native_kernels, graph_capture), the cost is fixed or per layer, and
# the compile's per-shape term is what the 1.5B's eight shapes add to the 135M's five. The spreads also decide
# where a new model's surprise goes: a fixed or per-layer cost rather than a per-GB one (which a larger model pays
# ten times over).
PHASES: dict[str, tuple[Term, ...]] = {
    "distributed_init": (
        Term("base", 0.3, 1.0, lambda x: 1.0 if x.ranks > 1 else 0.0, "s", lambda _x: "joining the ranks"),
        Term(
            "per_rank", 0.3, 1.0, lambda x: x.ranks if x.ranks > 1 else 0.0, "s/rank", lambda x: f"{x.ranks:.0f} ranks"
        ),
    ),
    "model_prepare": (
        _const("hit", 0.01, 0.3, "reading the prepared folder"),
        Term("miss", 0.05, 0.5, lambda x: x.miss("model"), "s", lambda _x: "preparing the model (model cache miss)"),
        Term(
            "miss_vocab",
            0.01,
            0.01,
            lambda x: x.miss("model") * x.get("vocab") / 1e3,
            "s/k tokens",
            lambda x: f"{x.get('vocab') / 1e3:.0f}k-token vocabulary",
        ),
    ),
    "tokenizer_init": (
        _const("base", 0.01),
        Term(
            "vocab",
            0.0045,
            0.01,
            lambda x: x.get("vocab") / 1e3,
            "s/k tokens",
            lambda x: f"{x.get('vocab') / 1e3:.0f}k-token vocabulary",
        ),
    ),
    # The grammar backend only: its tokenizer view is built after READY (engine/stages/grammar_init.py).
    "grammar_init": (
        _const("base", 0.001),
        Term(
            "vocab",
            0.00001,
            0.03,
            lambda x: x.get("vocab") / 1e3,
            "s/k tokens",
            lambda x: f"{x.get('vocab') / 1e3:.0f}k-token vocabulary (the grammar view)",
        ),
    ),
    # Reading or mapping the file: at the read probe's speed from the page cache, at the disk's for the rest; what
    # the loader de-quantizes is CPU work per GB.
    "load_weights": (
        _const("base", 0.05, 0.5),
        _per_layer("layers", 0.0012, 0.05),
        Term("stream", 19.5, 50.0, lambda x: x.stream_s, "x", _streamed, cpu=False),
        Term("convert", 30.0, 30.0, lambda x: x.convert_gb, "s/GB", lambda x: f"{x.convert_gb:.3f} GB de-quantized"),
        Term(
            "cold",
            2.8,
            5.0,
            lambda x: x.cold_gb,
            "s/GB",
            lambda x: f"{x.cold_gb:.3f} GB not in the page cache",
            cpu=False,
        ),
    ),
    "quantize_weights": (
        _const("base", 0.012),
        Term(
            "hit_read",
            5.0,
            30.0,
            lambda x: x.get("quantized") * x.hit("quant") * x.entry_stream_s,
            "x",
            lambda x: _streamed(x, x.get("entry_bytes") / GB / x.ranks) + " (the quant entry)",
            cpu=False,
        ),
        Term(
            "miss",
            40.0,
            40.0,
            lambda x: x.get("quantized") * x.miss("quant") * x.convert_gb if "quant" in x.pattern else 0.0,
            "s/GB",
            lambda x: f"{x.convert_gb:.3f} GB to quantize (quant cache miss)",
        ),
    ),
    "model_init": (
        _const("base", 0.05, 0.5),
        _per_layer("layers", 0.002, 0.05),
        Term("work", 0.02, 3.0, lambda x: x.weights_gb, "s/GB", lambda x: f"{x.weights_gb:.3f} GB laid out"),
    ),
    "native_kernels": (
        Term("base", 0.02, 0.3, _compiled, "s", lambda _x: "loading the kernels"),
        _per_layer("layers", 0.0007, 0.05, _compiled),
        Term(
            "work",
            0.005,
            4.0,
            lambda x: _compiled(x) * x.weights_gb,
            "s/GB",
            lambda x: f"{x.weights_gb:.3f} GB of layers switched",
        ),
        Term(
            "miss",
            30.0,
            60.0,
            lambda x: _compiled(x) * x.miss("native") if "native" in x.pattern else 0.0,
            "s",
            lambda _x: "building the kernels (native cache miss)",
        ),
    ),
    "dynamo_transform": (
        Term("hit", 0.03, 0.3, lambda x: _compiled(x) * x.hit("compile"), "s", lambda _x: "reading the compile entry"),
        Term("miss", 3.0, 5.0, lambda x: _compiled(x) * x.miss("compile"), "s", lambda _x: "tracing (compile miss)"),
        _per_layer("miss_layers", 0.22, 0.3, lambda x: _compiled(x) * x.miss("compile")),
    ),
    "graph_compile": (
        Term("hit", 0.15, 0.3, lambda x: _compiled(x) * x.hit("compile"), "s", lambda _x: "loading the compiled step"),
        Term(
            "miss",
            19.0,
            20.0,
            lambda x: _compiled(x) * x.miss("compile"),
            "s",
            lambda _x: "compiling with Inductor (compile miss)",
        ),
        Term(
            "miss_shapes",
            4.8,
            5.0,
            lambda x: _compiled(x) * x.miss("compile") * x.get("shapes"),
            "s/shape",
            lambda x: f"{x.get('shapes'):.0f} distinct weight shapes",
        ),
    ),
    "kv_cache_profiling": (
        _const("base", 0.006, 0.3, "the analytic peak, or reading the stored one"),
        Term(
            "measure",
            2.0,
            10.0,
            lambda x: (
                x.get("kv_measure")
                * x.miss("kv_profile")
                * x.get("params")
                / GB
                * x.get("batched_tokens")
                / 1e3
                / x.ranks
            ),
            "s per G params x k tokens",
            lambda x: f"a {x.get('batched_tokens'):.0f}-token forward of {x.get('params') / GB:.2f} G params",
        ),
    ),
    "kv_cache_init": (
        _const("base", 0.01),
        Term(
            "pool",
            0.005,
            0.05,
            lambda x: x.get("kv_bytes") / GB,
            "s/GB",
            lambda x: f"a {x.get('kv_bytes') / GB:.2f} GB KV pool",
            cpu=False,
        ),
    ),
    # One decode step per batch size: each walks the layers and streams the weights.
    "graph_capture": (
        Term("base", 0.01, 0.3, _compiled, "s", lambda _x: "checking the guards"),
        Term(
            "size_layers",
            0.0002,
            0.005,
            lambda x: _compiled(x) * x.get("capture_sizes") * x.get("layers"),
            "s per size and layer",
            lambda x: f"{x.get('capture_sizes'):.0f} batch sizes x {_layers(x)}",
        ),
        Term(
            "size_gb",
            0.025,
            0.2,
            lambda x: _compiled(x) * x.get("capture_sizes") * x.weights_gb,
            "s per size and GB",
            lambda x: f"{x.get('capture_sizes'):.0f} batch sizes x {x.weights_gb:.3f} GB",
        ),
        Term(
            "after_compile",
            0.02,
            1.0,
            lambda x: _compiled(x) * x.miss("compile") * x.weights_gb,
            "s/GB",
            lambda x: f"{x.weights_gb:.3f} GB run first right after a fresh compile",
        ),
    ),
    "warmup": (
        _const("base", 0.03),
        _per_layer("layers", 0.006, 0.03),
        Term("work", 0.45, 0.5, lambda x: x.weights_gb, "s/GB", lambda x: f"a few steps over {x.weights_gb:.3f} GB"),
        Term(
            "after_compile",
            0.15,
            0.5,
            lambda x: _compiled(x) * x.miss("compile") * x.weights_gb,
            "s/GB",
            lambda x: f"{x.weights_gb:.3f} GB run first right after a fresh compile",
        ),
        Term("eager_base", 0.3, 2.0, lambda x: 1.0 - _compiled(x), "s", lambda _x: "the eager path's first calls"),
        Term(
            "eager",
            1.0,
            5.0,
            lambda x: (1.0 - _compiled(x)) * x.get("params") / GB,
            "s per G params",
            lambda x: f"eager steps of {x.get('params') / GB:.2f} G params",
        ),
    ),
}


def terms_of(stage: str) -> tuple[Term, ...]:
    """The stage's terms; a stage the model does not know has one: a fixed cost whose prior is FALLBACK_PRIOR_S."""
    return PHASES.get(stage) or (_const("base", FALLBACK_PRIOR_S, 1.0),)
