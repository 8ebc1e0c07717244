"""torch.compile of the decode step, split into Dynamo tracing and Inductor compilation, with a persistent cache.

The decode step is `DecoderLM.decode(packed, caches)`: one int64 input tensor per step and the per-layer cache
tensors, no host synchronisation. It is traced once: the batch dimension is *unbacked* (Dynamo never specialises it,
so batch 1 runs unpadded on the same graph as batch 64) and the block-table width and cache sizes are dynamic, so no
request can trigger a compile. Each decoder layer is a nested compile region: Inductor compiles one layer and reuses it
for all, which is what keeps a cold compile of the 30-layer model short.

`torch.compile` does tracing and compiling lazily inside the first call, so its time cannot be attributed. The
backend here only records each graph Dynamo hands it (running it eagerly meanwhile); a later call compiles the
recorded graphs with Inductor inside the tracing context Dynamo left behind. That gives two honest stages:
dynamo_transform and graph_compile.

The Inductor cache and the explanation of compile-cache misses live in compile_cache.py (the artifact store); the
Inductor settings below are one of the compile cache's factors.
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .kv_cache import LayerKV
from .models.llama import DecoderLM


@dataclass(frozen=True)
class InductorSettings:
    """The Inductor options of the decode graph, chosen by measurement on the 2-core CPU (reports/decode.md):
    - cpp_wrapper off: Inductor 2.13 cannot emit nested compile regions (invoke_subgraph) in the C++ wrapper, and
      without regions a 30-layer graph took 121 s to compile cold instead of ~30 s.
    - freezing off: the projections are glowplug's native ops, which freezing cannot fold, and frozen graphs carry
      every weight inside the FX-graph cache entry (hundreds of MB).
    - max_autotune off: no matmul is left to Inductor's GEMM templates (the GEMVs are native ops).
    - vec_isa_ok on once the native kernels built with this compiler and -march=native: that proves the toolchain,
      and it skips Inductor's own ISA probe, which compiles and dlopens test programs in child Pythons (14 s cold,
      5 s even with a warm cache, here).
    - runtime asserts off: the Python wrapper checks every input's size and stride on every layer of every step
      (about 20 calls a layer); the runner builds those inputs itself, with fixed dtypes and layouts."""

    cpp_wrapper: bool = False
    freezing: bool = False
    max_autotune: bool = False
    vec_isa_ok: bool | None = None
    runtime_asserts: bool = False
    threads: int = 0

    def patch(self) -> Any:
        import torch._inductor.config as ic

        return ic.patch(
            {"cpp_wrapper": self.cpp_wrapper, "freezing": self.freezing, "max_autotune": self.max_autotune,
             "cpp.vec_isa_ok": self.vec_isa_ok, "size_asserts": self.runtime_asserts,
             "scalar_asserts": self.runtime_asserts, "alignment_asserts": self.runtime_asserts}  # fmt: skip
        )


class _Graph:
    """One Dynamo graph: eager until compiled, then the Inductor-compiled callable."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], tracing_ctx: Any,
                 settings: InductorSettings) -> None:  # fmt: skip
        self.gm = gm
        self.example_inputs = example_inputs
        self.tracing_ctx = tracing_ctx
        self.settings = settings
        self.fn: Callable[..., Any] = gm.forward
        self.compiled = False

    def compile(self) -> None:
        from torch._guards import tracing
        from torch._inductor.compile_fx import compile_fx

        with tracing(self.tracing_ctx), self.settings.patch():
            self.fn = compile_fx(self.gm, self.example_inputs)
        self.compiled = True

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


@dataclass
class DeferredInductor:
    """A torch.compile backend that separates tracing from compiling (see module docstring)."""

    settings: InductorSettings = field(default_factory=InductorSettings)
    graphs: list[_Graph] = field(default_factory=list)
    compile_immediately: bool = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> _Graph:
        from torch._guards import TracingContext

        graph = _Graph(gm, example_inputs, TracingContext.try_get(), self.settings)
        if self.compile_immediately:
            graph.compile()
        self.graphs.append(graph)
        return graph

    def compile_pending(self) -> int:
        pending = [g for g in self.graphs if not g.compiled]
        for g in pending:
            g.compile()
        self.compile_immediately = True
        return len(pending)


DecodeCallable = Callable[[torch.Tensor, list[LayerKV]], torch.Tensor]
_STEP_IDS = itertools.count()


class CompiledDecode:
    """The compiled decode step: (packed [B, DECODE_COLS + W], per-layer caches) -> logits [B, vocab].

    Calls go through torch.compile (tracing on the first, guard checks after) until `serving()` hands out the
    guard-free entry point for steady-state use."""

    def __init__(self, model: DecoderLM, backend: Callable[..., Any]) -> None:
        def decode_step(packed: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
                        kss: list[torch.Tensor | None], vss: list[torch.Tensor | None]) -> torch.Tensor:  # fmt: skip
            return model.decode(packed, [LayerKV(*c) for c in zip(ks, vs, kss, vss)])

        # Dynamo caches compiled code per code object, and every engine's closure shares one: engines built in the
        # same process (tests, benchmarks) would pile up entries until the recompile limit. A copy per engine keeps
        # each engine's graph its own.
        code = decode_step.__code__.replace(co_name=f"decode_step_{next(_STEP_IDS)}")
        self._step = types.FunctionType(code, decode_step.__globals__, code.co_name, None, decode_step.__closure__)
        # fullgraph: a graph break would be a silent slowdown (and a host sync).
        self._compiled = torch.compile(self._step, backend=backend, fullgraph=True)

    @staticmethod
    def _split(caches: list[LayerKV]) -> tuple[list[Any], ...]:
        return [c.k for c in caches], [c.v for c in caches], [c.k_scale for c in caches], [c.v_scale for c in caches]

    def __call__(self, packed: torch.Tensor, caches: list[LayerKV]) -> torch.Tensor:
        # Python floats (eps, softmax scale) stay constants: symbolic floats make AOTAutograd ask Dynamo to restart
        # tracing, which only works inside torch.compile's own loop, not in the deferred compile. Scoped to the call
        # so that no process-wide flag changes.
        with torch._dynamo.config.patch(specialize_float=True):
            return self._compiled(packed, *self._split(caches))

    def serving(self, caches: list[LayerKV]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The step for serving, bound to the real cache: Dynamo's guard evaluation skipped. Guards cost 0.8 ms a step
        for a bf16 model's ~400 input tensors, 1.7 ms with int8's aliased buffers. Safe here because there is exactly
        one compiled graph (capture proved that no batch size or width retraces) and the runner builds every input
        with the same dtypes, layouts and devices. With exactly one cache entry the entry's own code (what Dynamo
        runs after its guards pass) is called directly; otherwise guard evaluation is merely skipped."""
        split = self._split(caches)
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(self._step.__code__)
        if len(entries) == 1:
            step = self._step
            direct = types.FunctionType(entries[0].code, step.__globals__, step.__name__, step.__defaults__,
                                        step.__closure__)  # fmt: skip
            return lambda packed: direct(packed, *split)  # type: ignore[no-any-return]

        def guarded(packed: torch.Tensor) -> torch.Tensor:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._compiled(packed, *split)  # type: ignore[no-any-return]

        return guarded


def mark_decode_dynamic(packed: torch.Tensor, caches: list[LayerKV]) -> None:
    """Declare the dimensions that vary between steps: the batch (unbacked: never specialised, so batch 1 shares the
    graph), the block-table width, and the number of cache blocks (a scratch cache is traced, the real one runs)."""
    torch._dynamo.decorators.mark_unbacked(packed, 0)
    torch._dynamo.mark_dynamic(packed, 1)
    for c in caches:
        for t in (c.k, c.v, c.k_scale, c.v_scale):
            if t is not None:
                torch._dynamo.mark_dynamic(t, 0)


def inductor_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])
