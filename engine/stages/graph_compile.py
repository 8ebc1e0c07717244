"""Compile the traced decode step with Inductor (graph_compile_general_shape), or load the stored artifact's
compiled module (graph_compile_cached). A stored artifact that will not load is moved aside and the step traced
and compiled again here, with the reason on the row."""

from __future__ import annotations

import structlog

from ...profiling.names import Attr, Row
from ..compile import LoadedDecode
from .base import StageReport, one_line
from .context import EngineContext
from .dynamo_transform import inductor_settings, skipped_reason, trace


class GraphCompile:
    name = "graph_compile"
    needs: tuple[str, ...] = ("traced", "compile_cache")
    provides: tuple[str, ...] = ("decode_fn",)

    def run(self, ctx: EngineContext) -> StageReport:
        reason = skipped_reason(ctx)
        if reason is not None:
            return StageReport.skipped(reason)
        traced = ctx.need(ctx.traced, "the traced decode step", "dynamo_transform")
        cache = ctx.need(ctx.compile_cache, "the compile cache", "dynamo_transform")
        settings = inductor_settings(ctx)
        if isinstance(traced, LoadedDecode):
            try:
                ctx.decode_fn = cache.run(lambda: traced.compile(settings))
            except Exception as exc:  # noqa: BLE001 - a cached artifact that will not load is a miss
                structlog.get_logger("glowplug.compile").warning(
                    "the stored compiled decode step would not load; tracing and compiling again", error=one_line(exc))
                cache.drop_artifact(f"the compiled module would not load: {one_line(exc)}")
                traced = ctx.traced = trace(ctx)
        if not isinstance(traced, LoadedDecode):
            ctx.decode_fn = cache.run(lambda: traced.compile(settings))  # retried once in a fresh Inductor folder
        rebuilt = cache.explain_rebuilt()
        hit = cache.served_from_cache()
        cache.record(None if isinstance(traced, LoadedDecode) else ctx.decode_fn)
        attrs: dict[str, object] = {
            Attr.CACHE_HIT: hit,
            Attr.CACHE_KEY: cache.key,
            "glowplug.compile_cache_dir": str(cache.path),
            "glowplug.kernels_built": len(cache.rebuilt_kernels),
        }
        if not hit:
            attrs[Attr.CACHE_MISS_REASON] = cache.miss_reason or rebuilt or "compiled from the trace"
        return StageReport(
            attributes=attrs, row=Row.GRAPH_COMPILE_CACHED if hit else Row.GRAPH_COMPILE_GENERAL_SHAPE
        )
