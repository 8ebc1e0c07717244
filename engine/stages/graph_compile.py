"""Compile the traced decode step with Inductor (graph_compile_general_shape), or load the stored one
(graph_compile_cached): its replay plan when the entry has one (no Dynamo or Inductor import, see
engine/compile_replay.py), else the AOT artifact's compiled module. A stored artifact that will not load is moved
aside and the step traced and compiled again here, with the reason on the row."""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from ...profiling.names import Attr, Row
from ..compile import CompiledDecode, LoadedDecode, TracedDecode
from ..compile_cache import StoredReplay
from ..compile_replay import ReplayPlan, make_plan
from ..kv_cache import LayerKV
from ..model_runner import dummy_decode_batch
from glowplug.base.errors import one_line

from .base import StageReport
from .context import EngineContext
from .dynamo_transform import inductor_settings, scratch_cache, skipped_reason, trace

# The replay plan is recorded over a scratch cache whose varying sizes (blocks, batch, table width: 3/5 rows, 6/7
# table columns, so packed widths 10/11) differ from each other and from the cache's fixed dimensions in any model
# glowplug loads (block size 16+, head_dim 64+): sizes are matched to their sources by value.
PLAN_BLOCKS = 13
ATTR_REPLAY = "glowplug.compile_replay"


def _plan_inputs(ctx: EngineContext) -> Callable[[int, int], tuple[torch.Tensor, list[LayerKV]]]:
    scratch = scratch_cache(ctx, PLAN_BLOCKS)

    def inputs(batch: int, width: int) -> tuple[torch.Tensor, list[LayerKV]]:
        packed = dummy_decode_batch(batch, PLAN_BLOCKS - 1, scratch.block_size, ctx.device, width=width)
        return packed, scratch.layers

    return inputs


class GraphCompile:
    name = "graph_compile"
    # model, native, arch, dtype: skipped_reason, inductor_settings, the replay plan's scratch cache, a re-trace.
    needs: tuple[str, ...] = ("traced", "compile_cache", "model", "native", "arch", "dtype")
    # traced: replaced only when the stored entry will not load (the one provide not written on every path).
    provides: tuple[str, ...] = ("decode_fn", "traced")

    def run(self, ctx: EngineContext) -> StageReport:
        reason = skipped_reason(ctx)
        if reason is not None:
            return StageReport.skipped(reason)
        traced = ctx.need(ctx.traced, "the traced decode step", "dynamo_transform")
        cache = ctx.need(ctx.compile_cache, "the compile cache", "dynamo_transform")
        settings = inductor_settings(ctx)
        log = structlog.get_logger("glowplug.compile")
        replay = "not stored"
        if isinstance(traced, StoredReplay):
            try:
                ctx.decode_fn = traced.load(cache.path)
                replay = "loaded"
            except Exception as exc:  # noqa: BLE001 - the plan is an optimisation over the full artifact
                replay = f"would not load ({one_line(exc)}); loaded the AOT artifact"
                log.warning("the replay plan would not load; loading the AOT artifact", error=one_line(exc))
                try:
                    traced = ctx.traced = traced.full()
                except Exception as full_exc:  # noqa: BLE001 - a damaged artifact is a miss
                    cache.drop_artifact(f"the AOT artifact would not load: {one_line(full_exc)}")
                    traced = ctx.traced = trace(ctx)
        if isinstance(traced, LoadedDecode):
            try:
                ctx.decode_fn = cache.run(lambda: traced.compile(settings))
            except Exception as exc:  # noqa: BLE001 - a cached artifact that will not load is a miss
                log.warning("the stored compiled decode step would not load; tracing and compiling again",
                            error=one_line(exc))  # fmt: skip
                cache.drop_artifact(f"the compiled module would not load: {one_line(exc)}")
                traced = ctx.traced = trace(ctx)
        step: CompiledDecode | None = None  # compiled here from a trace: stored, with its plan
        plan: ReplayPlan | None = None
        if isinstance(traced, TracedDecode):
            step = ctx.decode_fn = cache.run(lambda: traced.compile(settings))  # retried once in a fresh folder
            try:
                plan = make_plan(step, step.model, _plan_inputs(ctx), cache.path)
                replay = "written"
            except Exception as exc:  # noqa: BLE001 - without a plan, warm starts load the AOT artifact
                replay = f"not written ({one_line(exc)})"
                log.info("no replay plan for the compiled decode step; warm starts load the AOT artifact",
                         reason=one_line(exc))  # fmt: skip
        rebuilt = cache.explain_rebuilt()
        hit = cache.served_from_cache()
        cache.record(step, plan)
        attrs: dict[str, object] = {
            Attr.CACHE_HIT: hit,
            Attr.CACHE_KEY: cache.key,
            "glowplug.compile_cache_dir": str(cache.path),
            "glowplug.kernels_built": len(cache.rebuilt_kernels),
            ATTR_REPLAY: replay,
        }
        if not hit:
            attrs[Attr.CACHE_MISS_REASON] = cache.miss_reason or rebuilt or "compiled from the trace"
        return StageReport(
            attributes=attrs, row=Row.GRAPH_COMPILE_CACHED if hit else Row.GRAPH_COMPILE_GENERAL_SHAPE
        )
