"""torch.compile of the decode step, split into Dynamo tracing and Inductor compilation, with a persistent cache.

`torch.compile` does both halves lazily inside the first call, so its time cannot be attributed. The backend here
only records each graph Dynamo hands it (running it eagerly meanwhile); a later call compiles the recorded graphs
with Inductor inside the tracing context Dynamo left behind. That gives two honest stages: dynamo_transform and
graph_compile. Graphs that appear later (new batch-size specialisations during capture) compile at once.

The Inductor cache lives under the glowplug cache dir, one folder per key; the key hashes a manifest of factors
(model config, engine config, quantization, torch version, glowplug source, device), and on a miss the last
manifest for the same model says which factor changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .attention import AttentionMetadata
from .config import EngineConfig
from .models.arch import ModelArch
from .models.llama import DecoderLM

MANIFEST = "manifest.json"


class _Graph:
    """One Dynamo graph: eager until compiled, then the Inductor-compiled callable."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], tracing_ctx: Any) -> None:
        self.gm = gm
        self.example_inputs = example_inputs
        self.tracing_ctx = tracing_ctx
        self.fn: Callable[..., Any] = gm.forward
        self.compiled = False

    def compile(self) -> None:
        from torch._guards import tracing
        from torch._inductor.compile_fx import compile_fx

        with tracing(self.tracing_ctx):
            self.fn = compile_fx(self.gm, self.example_inputs)
        self.compiled = True

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


@dataclass
class DeferredInductor:
    """A torch.compile backend that separates tracing from compiling (see module docstring)."""

    graphs: list[_Graph] = field(default_factory=list)
    compile_immediately: bool = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> _Graph:
        from torch._guards import TracingContext

        graph = _Graph(gm, example_inputs, TracingContext.try_get())
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


def make_decode_fn(model: DecoderLM, backend: DeferredInductor) -> Callable[..., torch.Tensor]:
    def decode_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions, meta))

    # The tracing inputs mark batch, context width and cache size dynamic, so one graph serves every batch >= 2
    # and every context, capture only warms it, and no request ever triggers a compile. fullgraph=True: a graph
    # break would be a silent slowdown.
    compiled = torch.compile(decode_step, backend=backend, fullgraph=True)

    def run(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # Python floats (eps, softmax scale) must stay constants: symbolic floats make AOTAutograd ask Dynamo to
        # restart tracing, which only works inside torch.compile's own loop, not in our deferred compile. Scoped
        # to the call so that no process-wide flag changes.
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(input_ids, positions, meta)

    return run


def glowplug_source_hash() -> str:
    """Hash of the installed glowplug sources: a code change must never reuse a stale compiled graph."""
    import glowplug

    h = hashlib.sha256()
    roots = {Path(p) for p in glowplug.__path__}
    for sub in ("engine", "kernels"):
        mod = __import__(f"glowplug.{sub}", fromlist=["__path__"])
        roots |= {Path(p) for p in mod.__path__}
    for root in sorted(roots):
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def compile_factors(config: EngineConfig, arch: ModelArch, device: str) -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    return {
        "model_config": arch.compute_hash(),
        "engine_config": config.compute_hash(),
        "quantization": f"{config.quant.quantization}/g{config.quant.group_size}/kv-{config.cache.kv_cache_dtype}",
        "torch": torch.__version__,
        "glowplug_source": glowplug_source_hash(),
        "device": device if device != "cpu" else f"cpu/{cpu}",
    }


@dataclass(frozen=True)
class CompileCache:
    key: str
    path: Path
    factors: dict[str, str]
    miss_reason: str | None  # None when a manifest for this key already exists


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _what_changed(last: dict[str, Any], factors: dict[str, str], fields: dict[str, Any]) -> str:
    old_factors = last.get("factors") if isinstance(last.get("factors"), dict) else {}
    changed = [k for k in factors if old_factors.get(k) != factors[k]]
    if not changed:
        return "cache folder missing"
    parts = []
    for name in changed:
        if name == "engine_config":
            old = last.get("engine_config") if isinstance(last.get("engine_config"), dict) else {}
            diffs = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in fields.items() if old.get(k) != v]
            parts.append("engine_config (" + ", ".join(diffs) + ")" if diffs else name)
        else:
            parts.append(name)
    return "changed: " + "; ".join(parts)


def open_compile_cache(cache_root: Path, factors: dict[str, str], config: EngineConfig) -> CompileCache:
    """Record this start's manifest; say what changed when its key is new; point Inductor at the cache.

    One Inductor folder serves every key: Inductor keys its own entries by graph and options, and a fresh folder
    would pay the one-time C++ toolchain probe (15-20 s here) again for every config.
    """
    key = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:16]
    base = cache_root / "compile"
    path = base / key
    last_path = base / f"last-{factors['model_config']}.json"
    fields = _flatten(config.hash_factors())
    reason: str | None = None
    if not (path / MANIFEST).is_file():
        if last_path.is_file():
            reason = _what_changed(json.loads(last_path.read_text()), factors, fields)
        else:
            reason = "first start for this model"
    path.mkdir(parents=True, exist_ok=True)
    manifest = json.dumps({"factors": factors, "engine_config": fields}, indent=2, sort_keys=True, default=str)
    (path / MANIFEST).write_text(manifest)
    last_path.write_text(manifest)
    # Inductor reads this on every cache lookup; set here (not at import) so only a compiling engine changes it.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inductor")
    return CompileCache(key=key, path=path, factors=factors, miss_reason=reason)


def inductor_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return int(c["fxgraph_cache_hit"]), int(c["fxgraph_cache_miss"])
