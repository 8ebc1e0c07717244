"""Compile the traced graphs with Inductor; a warm persistent cache makes this graph_compile_cached."""

from __future__ import annotations

from ...profiling.names import Attr, Row
from ..compile import inductor_cache_counts
from .base import StageReport
from .dynamo_transform import skipped_reason
from .context import EngineContext


class GraphCompile:
    name = "graph_compile"
    needs: tuple[str, ...] = ("backend", "compile_cache")
    provides: tuple[str, ...] = ("compiled_graphs",)

    def run(self, ctx: EngineContext) -> StageReport:
        reason = skipped_reason(ctx)
        if reason is not None:
            return StageReport.skipped(reason)
        backend = ctx.need(ctx.backend, "the traced graphs", "dynamo_transform")
        cache = ctx.need(ctx.compile_cache, "the compile cache", "dynamo_transform")
        hits0, misses0 = inductor_cache_counts()
        compiled = cache.run(backend.compile_pending)  # retried once in a fresh Inductor cache if it fails
        hits, misses = (a - b for a, b in zip(inductor_cache_counts(), (hits0, misses0)))
        rebuilt = cache.explain_rebuilt(hits, misses)
        hit = cache.served_from_cache(hits, misses)
        attrs: dict[str, object] = {
            Attr.CACHE_HIT: hit,
            Attr.CACHE_KEY: cache.key,
            "glowplug.graphs_compiled": compiled,
            "glowplug.inductor_cache_hits": hits,
            "glowplug.inductor_cache_misses": misses,
            "glowplug.compile_cache_dir": str(cache.path),
        }
        if not hit:
            attrs[Attr.CACHE_MISS_REASON] = (cache.miss_reason or rebuilt
                                             or f"{misses} graph(s) not in the Inductor cache")  # fmt: skip
        return StageReport(
            attributes=attrs, row=Row.GRAPH_COMPILE_CACHED if hit else Row.GRAPH_COMPILE_GENERAL_SHAPE
        )
