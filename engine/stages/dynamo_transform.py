"""Trace the decode step with Dynamo (no Inductor yet: that is graph_compile's time), or, on a warm start, load
the stored entry instead (its replay plan, or else the AOT artifact's traced code and guards): the row then says
"cache hit" with the load's time."""

from __future__ import annotations

import torch

from ...profiling.names import Attr
from ..compile import InductorSettings, TracedDecode, mark_decode_dynamic, trace_decode
from ..compile_cache import open_compile_cache
from ..kv_cache import KVCache
from ..model_runner import dummy_decode_batch
from .base import StageReport
from .context import EngineContext

TRACE_BATCH = 2  # any size: the batch dimension is unbacked, never specialised
TRACE_BLOCKS = 5  # scratch cache blocks (the real cache is not allocated yet; its size is symbolic in the graph)


def inductor_settings(ctx: EngineContext) -> InductorSettings:
    native = ctx.native is not None and ctx.native.available
    return InductorSettings(vec_isa_ok=True if native else None, threads=torch.get_num_threads())


def skipped_reason(ctx: EngineContext) -> str | None:
    """Why the decode step is not compiled, or None. Quantized layers need their native kernels in the graph: the
    stock packed kernels (aten int4/int8) do not trace with a symbolic batch."""
    if not ctx.config.compile_enabled():
        return f"--compile {ctx.config.compile}"
    if ctx.config.quant.quantization != "none" and ctx.model is not None:
        from glowplug.kernels.modules import DecodeKernel, QuantLinear

        missing = sum(isinstance(m, QuantLinear) and m.kernel is DecodeKernel.STOCK for m in ctx.model.modules())
        if missing:
            why = ctx.native.reason if ctx.native is not None and not ctx.native.available else (
                "they need AVX512-BF16 and an input size that is a multiple of 32")  # fmt: skip
            return f"eager: {missing} quantized layers have no native decode kernel ({why})"
    return None


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
    needs: tuple[str, ...] = ("model", "native", "arch", "dtype")
    provides: tuple[str, ...] = ("traced", "compile_cache")

    def run(self, ctx: EngineContext) -> StageReport:
        reason = skipped_reason(ctx)
        if reason is not None:
            return StageReport.skipped(reason)
        model = ctx.need(ctx.model, "the model", "model_init")
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        cache = open_compile_cache(ctx.cache_root, ctx.config, arch, ctx.dtype, ctx.device, inductor_settings(ctx),
                                   model)  # fmt: skip
        ctx.compile_cache = cache
        attrs: dict[str, object] = {Attr.CACHE_KEY: cache.key, Attr.CACHE_HIT: cache.loaded is not None}
        if cache.loaded is not None:
            ctx.traced = cache.loaded  # the stored trace and its guards: nothing to trace
            return StageReport(attributes=attrs)
        ctx.traced = trace(ctx)
        attrs["glowplug.graph_nodes"] = ctx.traced.nodes
        if cache.miss_reason:
            attrs[Attr.CACHE_MISS_REASON] = cache.miss_reason
        return StageReport(attributes=attrs)
