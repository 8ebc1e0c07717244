"""Trace the decode step with Dynamo (no Inductor yet: that is graph_compile's time), or, on a warm start, load
the stored entry instead (its replay plan, or else the AOT artifact's traced code and guards): the row then says
"cache hit" with the load's time.

When this torch lacks the internals the compile is made of (base/torch_compat.py: a version outside the supported
range, or a private name missing or changed), or the trace fails, `--compile auto` goes on eagerly: the stage is
skipped with the reason, which `compile_fallback` carries to graph_compile and graph_capture, so every compile row
says why. `--compile on` fails the start instead.
"""

from __future__ import annotations

import structlog
import torch

from glowplug.base import torch_compat
from glowplug.base.errors import one_line
from glowplug.engine.compile import InductorSettings, TracedDecode, mark_decode_dynamic, trace_decode
from glowplug.engine.compile_cache import open_compile_cache
from glowplug.engine.config import EngineConfig
from glowplug.engine.kv_cache import KVCache
from glowplug.engine.model_runner import dummy_decode_batch
from glowplug.engine.start_estimate import HIT, MISS
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport

TRACE_BATCH = 2  # any size: the batch dimension is unbacked, never specialised
TRACE_BLOCKS = 5  # scratch cache blocks (the real cache is not allocated yet; its size is symbolic in the graph)


def native_level(ctx: EngineContext) -> str | None:
    """The ISA level of the native kernels the step will call (a compile factor), None without them. The probe
    runs before they load: it predicts the level the machine (and GLOWPLUG_MAX_CPU_ISA) chooses."""
    if ctx.native is None or not ctx.native.available:
        return None
    if ctx.native.level:
        return str(ctx.native.level)
    from glowplug.base.machine import isa_choice

    return isa_choice().level


def layer_formats(ctx: EngineContext) -> str | None:
    """Under --quantization auto, every layer's kernel format (a compile factor: the graph holds one op per layer
    format, and the configured "auto" alone does not say which file's formats were compiled), else None."""
    formats = ctx.layer_formats()
    return formats.signature() if formats is not None and formats.quantized else None


def inductor_settings(ctx: EngineContext) -> InductorSettings:
    native = ctx.native is not None and ctx.native.available
    return InductorSettings(vec_isa_ok=True if native else None, threads=torch.get_num_threads())


def skipped_reason(ctx: EngineContext, fallback: str | None) -> str | None:
    """Why the decode step is not compiled, or None. Quantized layers need a decode kernel that traces in the graph
    (the native op on the CPU, the Triton op on CUDA: see native_kernels): the stock packed kernels (aten int4/int8,
    the Triton launchers) do not trace with a symbolic batch.

    fallback: an earlier compile stage's `compile_fallback` (None for dynamo_transform, the first of them): passed
    in rather than read here, so each stage reads the slot only when it declares it."""
    if not ctx.config.compile_enabled():
        return ctx.config.compile_off_reason()
    if fallback is not None:
        return fallback
    if ctx.model is not None:
        from glowplug.kernels.modules import DecodeKernel, QuantLinear

        missing = sum(isinstance(m, QuantLinear) and m.kernel is DecodeKernel.STOCK for m in ctx.model.modules())
        if missing and ctx.device.startswith("cuda"):
            from glowplug.kernels.triton.ops import unsupported_reason

            why = unsupported_reason(ctx.device) or "the native_kernels stage did not switch them"
            return f"eager: {missing} quantized layers have no Triton decode kernel ({why})"
        if missing:
            why = (
                ctx.native.reason
                if ctx.native is not None and not ctx.native.available
                else ("they need AVX512-BF16 and an input size that is a multiple of 32")
            )
            return f"eager: {missing} quantized layers have no native decode kernel ({why})"
    return None


def fall_back_to_eager(
    ctx: EngineContext, why: str, exc: BaseException | None = None, attributes: dict[str, object] | None = None
) -> StageReport:
    """`--compile auto`: run the decode step eagerly, and say why on this stage's row and (through
    `compile_fallback`) on the later compile stages'. `--compile on` asked for the compile: the start fails, with
    `exc` itself when there is one (the same error a start without this fallback raised)."""
    if ctx.config.compile == "on":
        if exc is not None:
            raise exc
        raise RuntimeError(f"--compile on cannot compile the decode step: {why}")
    ctx.compile_fallback = f"eager: {why}"
    structlog.get_logger("glowplug.compile").warning("the decode step runs eagerly (--compile auto)", reason=why)
    return StageReport.skipped(ctx.compile_fallback, attributes)  # type: ignore[arg-type]


def scratch_cache(ctx: EngineContext, blocks: int) -> KVCache:
    """A small cache shaped like the real one (which is not allocated yet; its size is symbolic in the graph)."""
    arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
    return KVCache(
        num_layers=arch.num_hidden_layers,
        num_blocks=blocks,
        block_size=ctx.config.cache.block_size,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        dtype=ctx.dtype,
        device=ctx.device,
        int8=ctx.config.cache.kv_cache_dtype == "int8",
    )


def trace(ctx: EngineContext) -> TracedDecode:
    """Dynamo's capture of one decode step over a scratch cache, with the varying dimensions marked dynamic."""
    model = ctx.need(ctx.model, "the model", "model_init")
    scratch = scratch_cache(ctx, TRACE_BLOCKS)
    packed = dummy_decode_batch(TRACE_BATCH, TRACE_BLOCKS - 1, scratch.block_size, ctx.device)
    mark_decode_dynamic(packed, scratch.layers)
    with torch.inference_mode():
        return trace_decode(model, packed, scratch.layers)


class DynamoTransform:
    name = "dynamo_transform"
    # model_dir: under --quantization auto the per-layer formats (a compile factor) come from the GGUF's table.
    needs: tuple[str, ...] = ("model", "native", "arch", "dtype", "model_dir")
    provides: tuple[str, ...] = ("traced", "compile_cache", "compile_fallback")
    caches: tuple[str, ...] = ("compile",)

    def cpu_bound(self, config: EngineConfig) -> bool:
        """A cold trace or compile keeps every core busy (engine/stages/schedule.py runs such stages one at a time on
        few cores); a warm start's load is short, so holding a stage back behind it costs little."""
        return config.compile_enabled()

    def cache_probe(self, ctx: EngineContext) -> dict[str, str]:
        """For the ETA: whether the compiled step of this configuration is stored (graph_compile's time depends
        on the same entry). Nothing to say when the step will not be compiled."""
        if skipped_reason(ctx, None) is not None:
            return {}
        from glowplug.base.artifacts import ArtifactStore
        from glowplug.base.artifacts.caches import COMPILE
        from glowplug.engine.compile_cache import compile_factors

        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        factors = compile_factors(
            ctx.config, arch, ctx.dtype, ctx.device, inductor_settings(ctx), native_level(ctx), layer_formats(ctx)
        )
        return {"compile": HIT if ArtifactStore(ctx.cache_root).probe(COMPILE, factors) else MISS}

    def run(self, ctx: EngineContext) -> StageReport:
        reason = skipped_reason(ctx, None)
        if reason is not None:
            return StageReport.skipped(reason)
        model = ctx.need(ctx.model, "the model", "model_init")
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        # The compiler tier is checked where the entry needs it (no replay plan: the AOT artifact, or a trace).
        compat = torch_compat.check_runtime()
        if not compat.ok:
            return fall_back_to_eager(ctx, f"torch internals unavailable ({compat.reason})")
        try:
            cache = open_compile_cache(
                ctx.cache_root,
                ctx.config,
                arch,
                ctx.dtype,
                ctx.device,
                inductor_settings(ctx),
                model,
                native_level(ctx),
                layer_formats(ctx),
            )
        except torch_compat.TorchInternalsUnavailable as exc:
            return fall_back_to_eager(ctx, f"torch internals unavailable ({exc})")
        ctx.compile_cache = cache
        attrs: dict[str, object] = {Attr.CACHE_KEY: cache.key, Attr.CACHE_HIT: cache.loaded is not None}
        if cache.loaded is not None and cache.bundle:
            attrs[Attr.CACHE_FROM_BUNDLE] = cache.bundle
        if cache.loaded is not None:
            ctx.traced = cache.loaded  # the stored trace and its guards: nothing to trace
            return StageReport(attributes=attrs)  # type: ignore[arg-type]
        try:
            ctx.traced = trace(ctx)
        except Exception as exc:  # noqa: BLE001 - under --compile auto any failed trace means eager, with the reason
            return fall_back_to_eager(ctx, f"the decode step did not trace ({one_line(exc)})", exc, attrs)
        attrs[Attr.GRAPH_NODES] = ctx.traced.nodes
        if cache.miss_reason:
            attrs[Attr.CACHE_MISS_REASON] = cache.miss_reason
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
