"""The decode step compiled ahead of time: Dynamo tracing and Inductor compilation as two honest stages, and a
serialized artifact that lets a warm start skip both.

The decode step is `decode_step(model, packed, ks, vs, kss, vss)`: one int64 input tensor per step and the per-layer
cache tensors, no host synchronisation. It is traced once: the batch dimension is *unbacked* (Dynamo never
specialises it, so batch 1 runs unpadded on the same graph as batch 64) and the block-table width and cache sizes
are dynamic, so no request can trigger a compile. Each decoder layer is a nested compile region: Inductor compiles
one layer and reuses it for all, which is what keeps a cold compile of the 30-layer model short.

Why torch 2.13's AOT compile (`torch._dynamo.aot_compile`) and not the alternatives, from trying each on the 2-core
CPU with SmolLM2 (the current warm and cold rows are in reports/startup/, made by `glowplug bench startup`):
- `torch.compile` with a warm Inductor cache (what glowplug did before) re-traces with Dynamo on every start and
  then looks the FX graph up in Inductor's cache: both rows cost seconds on every warm start.
- Dynamo's "caching precompile" (`torch._dynamo.config.caching_precompile`) is tied to `torch.compile`'s lazy
  first call, so tracing and compiling cannot be timed apart, and its cache is keyed by code objects and inlined
  sources that glowplug's artifact store cannot explain a miss of.
- AOT compile serializes the traced bytecode, the guards and the bundled Inductor output in one ~1.3 MB
  artifact. Loading it runs no Dynamo tracing, but it imports `torch._dynamo` and Inductor's runtime modules, which
  is most of its time; so a warm start loads the replay plan stored beside it instead (engine/compile_replay.py),
  and this artifact is the fallback.
torch.compile(...).aot_compile() does capture and compile in one call; the two halves are called separately here
(`trace_decode`, `TracedDecode.compile`) so the start-up table books them to dynamo_transform and graph_compile.

The artifact and Inductor's kernel folder live in the artifact store (compile_cache.py); the Inductor settings
below are one of the compile cache's factors. Every private torch name used here comes from base/torch_compat.py,
which checks that this torch has them before the first is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from glowplug.base import torch_compat

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
        return torch_compat.patch_config(
            "inductor",
            {
                "cpp_wrapper": self.cpp_wrapper,
                "freezing": self.freezing,
                "max_autotune": self.max_autotune,
                "cpp.vec_isa_ok": self.vec_isa_ok,
                "size_asserts": self.runtime_asserts,
                "scalar_asserts": self.runtime_asserts,
                "alignment_asserts": self.runtime_asserts,
            },
        )


def decode_step(
    model: DecoderLM,
    packed: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    kss: list[torch.Tensor | None],
    vss: list[torch.Tensor | None],
) -> torch.Tensor:
    """The traced function. Module level with the model as an argument: a serialized artifact can only refer to
    its function's globals and arguments, not to a closure over one engine's model."""
    return model.decode(packed, [LayerKV(*c) for c in zip(ks, vs, kss, vss)])


def split_caches(caches: list[LayerKV]) -> tuple[list[Any], ...]:
    return [c.k for c in caches], [c.v for c in caches], [c.k_scale for c in caches], [c.v_scale for c in caches]


def _trace_config() -> Any:
    """Scoped so that no process-wide flag changes:
    - Python floats (eps, softmax scale) stay constants: symbolic floats make AOTAutograd ask Dynamo to restart
      tracing, which a separated capture cannot do.
    - No automatic dynamic shapes: exactly the dimensions mark_decode_dynamic names vary. Dynamo otherwise keeps
      per-code-object memory of earlier traces of decode_step in this process (other engines, other block sizes)
      and makes more dimensions symbolic, which broke the reuse of the nested layer regions."""
    return torch_compat.patch_config("dynamo", {"specialize_float": True, "automatic_dynamic_shapes": False})


# What torch's own AOT compile sets while compiling, so that the Inductor output is bundled into the artifact.
_BUNDLE_AUTOGRAD = {
    "strict_autograd_cache": True,
    "bypass_autograd_cache_key": True,
    "bundled_autograd_cache": True,
    "force_non_lazy_backward_lowering": True,
    "force_autograd_cache": True,
}


@dataclass
class TracedDecode:
    """dynamo_transform's cold result: the captured graph, waiting for Inductor."""

    capture: Any  # torch_compat.CaptureOutput
    model: DecoderLM
    nodes: int

    def compile(self, settings: InductorSettings) -> CompiledDecode:
        """Inductor on the captured graph, then the guards: what graph_compile does on a cold start."""
        from glowplug.base.torch_compat import (
            BundledAOTAutogradSerializableCallable,
            CheckFunctionManager,
            CompileArtifacts,
            Hooks,
            InductorWrapper,
            SourceInfo,
            TracingContext,
            aot_compiled_function,
            dynamo_timed,
            get_metrics_context,
            get_signature,
            get_traced_fn,
            graph_device_type,
            set_graph_backend_id,
            tracing,
        )

        graph_out, backend_in = self.capture.graph_capture_output, self.capture.backend_input
        gm = backend_in.graph_module
        set_graph_backend_id(gm, backend_in.backend_id)
        ctx = TracingContext(backend_in.fake_mode)
        ctx.tensor_to_context = backend_in.tensor_to_context
        backend = InductorWrapper(None, None, None)

        def serializable(entries: Any) -> list[bool]:
            # Globals are not the artifact's to guard (they are re-bound at load), nor are guard kinds that cannot
            # be serialized: the same filter torch's own AOT compile applies.
            unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
            return [not (g.is_global or g.guard_type in unsupported) for g in entries]

        fn, _ = get_traced_fn(decode_step)
        # Inductor and the guard builder book their timings into Dynamo's metrics context, which torch.compile would
        # have opened. The guards include the global grad state, built as it was while tracing (inference mode):
        # so is every call.
        with _trace_config(), get_metrics_context(), dynamo_timed("glowplug_graph_compile"), torch.inference_mode():
            with settings.patch(), tracing(ctx), torch_compat.patch_config("functorch", _BUNDLE_AUTOGRAD):
                compiled = BundledAOTAutogradSerializableCallable(backend(gm, backend_in.example_inputs))
            check = graph_out.build_guards(
                fn.__code__, hooks=Hooks(guard_filter_fn=serializable), save=True, strict_error=True
            )
        source_info = SourceInfo(inlined_sources=set())
        for code in graph_out.traced_code:
            source_info.add_code(code)
        artifacts = CompileArtifacts(
            signature=get_signature(fn),
            guard_manager=_load_guards(check.guards_state, fn.__code__, {}),
            guards_state=check.guards_state,
            backend_id=backend_in.backend_id,
            compiled_fn=compiled,
            original_code=fn.__code__,
            runtime_env=graph_out.get_runtime_env(),
            source_info=source_info,
            device_type=graph_device_type(gm.graph),
            backend_name="inductor",
        )
        return CompiledDecode(aot_compiled_function(artifacts, fn.__globals__), self.model)


def trace_decode(model: DecoderLM, packed: torch.Tensor, caches: list[LayerKV]) -> TracedDecode:
    """Dynamo's full-graph capture of one decode step over example inputs (dims marked by mark_decode_dynamic)."""
    from glowplug.base.torch_compat import dynamo_timed, fullgraph_capture, get_metrics_context

    with (
        _trace_config(),
        get_metrics_context(),
        dynamo_timed("glowplug_fullgraph_capture"),
        torch_compat.patch_config("functorch", {"strict_autograd_cache": True}),
    ):
        capture = fullgraph_capture(decode_step, (model, packed, *split_caches(caches)), {})
    nodes = len(capture.backend_input.graph_module.graph.nodes)
    return TracedDecode(capture, model, nodes)


def _load_guards(guards_state: bytes, code: Any, used_globals: dict[str, Any]) -> Any:
    """A guard manager from serialized guards. A cold compile uses one too, rebuilt from what it is about to store,
    rather than the one Dynamo built in memory: the two read tensors' dispatch keys differently (the in-memory one
    net of inference mode's excluded keys, the loaded one not), and a start must behave the same cold or warm."""
    from glowplug.base.torch_compat import load_guard_manager, load_guards_state

    return load_guard_manager(load_guards_state(guards_state), code, {**decode_step.__globals__, **used_globals})


@contextlib.contextmanager
def _guard_mode() -> Iterator[None]:
    """Where the guards are checked: grad off, as when traced, but outside inference mode, whose excluded keys a
    loaded guard manager does not subtract (see _load_guards). The runner's own inputs are inference tensors;
    serving() skips the guards, which graph_capture checked on inputs built here."""
    with torch.inference_mode(False), torch.no_grad():
        yield


@dataclass
class LoadedDecode:
    """dynamo_transform's warm result: the artifact unpickled and its guards rebuilt; Inductor's part not yet
    loaded (that is graph_compile's time)."""

    state: dict[str, Any]
    model: DecoderLM

    @classmethod
    def read(cls, data: bytes, model: DecoderLM) -> LoadedDecode:
        from glowplug.base.torch_compat import AOTCompileUnpickler, SerializedCode

        state = AOTCompileUnpickler({}, io.BytesIO(data)).load()
        state["runtime_env"] = dataclasses.replace(
            state["runtime_env"], bytecode=SerializedCode.to_code_object(state["runtime_env"].bytecode)
        )
        state["original_code"] = SerializedCode.to_code_object(state["original_code"])
        state["guard_manager"] = _load_guards(
            state["guards_state"], state["original_code"], state["runtime_env"].used_globals
        )
        return cls(state, model)

    def compile(self, settings: InductorSettings) -> CompiledDecode:
        """Load Inductor's compiled module from the artifact (kernels from the Inductor folder, built if absent)."""
        from glowplug.base.torch_compat import CompileArtifacts, aot_compiled_function

        state = dict(self.state)
        deserializer, compiled_state = state["compiled_fn"]
        with settings.patch(), torch_compat.patch_config("inductor", {"enable_autograd_for_aot": True}):
            state["compiled_fn"] = deserializer(compiled_state)
        fn = aot_compiled_function(CompileArtifacts(**state), decode_step.__globals__)
        return CompiledDecode(fn, self.model)


class CompiledDecode:
    """The compiled decode step: (packed [B, DECODE_COLS + W], per-layer caches) -> logits [B, vocab].

    `__call__` checks the guards first (capture, tests); `serving()` hands out the guard-free entry point."""

    def __init__(self, fn: Any, model: DecoderLM) -> None:
        self.fn = fn  # torch_compat.AOTCompiledFunction
        self.model = model

    def guards_pass(self, packed: torch.Tensor, caches: list[LayerKV]) -> bool:
        with _guard_mode():
            return bool(self.fn.guard_check(self.model, packed, *split_caches(caches)))

    def guard_failure(self, packed: torch.Tensor, caches: list[LayerKV]) -> str:
        with _guard_mode():
            f_locals = self.fn.prepare_f_locals(self.model, packed, *split_caches(caches))
            return str(torch_compat.aot_guard_manager(self.fn).check_verbose(f_locals))

    def __call__(self, packed: torch.Tensor, caches: list[LayerKV]) -> torch.Tensor:
        """One step, after checking the guards (a failure names the guard)."""
        if not self.guards_pass(packed, caches):
            raise RuntimeError(
                f"the compiled decode step's guards reject these inputs: {self.guard_failure(packed, caches)}"
            )
        return self.unguarded(packed, caches)

    def unguarded(self, packed: torch.Tensor, caches: list[LayerKV]) -> torch.Tensor:
        """One step without the guard check: for inputs the runner built (see serving())."""
        return self.fn.fn(self.model, packed, *split_caches(caches))  # type: ignore[no-any-return]

    def serving(self, caches: list[LayerKV]) -> Callable[[torch.Tensor], torch.Tensor]:
        """The step for serving, bound to the real cache, without guard evaluation, which would check each of the
        model's hundreds of input tensors on every step. Safe because graph_capture checked the guards at every
        batch size against this cache, and the runner builds every input with the same dtypes, layouts and
        devices."""
        split, model, step = split_caches(caches), self.model, self.fn.fn
        return lambda packed: step(model, packed, *split)  # type: ignore[no-any-return]

    def serialize(self) -> bytes:
        from glowplug.base.torch_compat import AOTCompiledFunction

        return AOTCompiledFunction.serialize(self.fn).serialized_data


def mark_decode_dynamic(packed: torch.Tensor, caches: list[LayerKV]) -> None:
    """Declare the dimensions that vary between steps: the batch (unbacked: never specialised, so batch 1 shares the
    graph), the block-table width, and the number of cache blocks (a scratch cache is traced, the real one runs)."""
    from glowplug.base.torch_compat import mark_dynamic, mark_unbacked

    mark_unbacked(packed, 0)
    mark_dynamic(packed, 1)
    for c in caches:
        for t in (c.k, c.v, c.k_scale, c.v_scale):
            if t is not None:
                mark_dynamic(t, 0)
