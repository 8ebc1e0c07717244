"""Set up the tensor-parallel group (engine/distributed.py): start the workers (rank 0 of a self-launched group),
wait for every rank to join, create the process groups and pass the first barrier. Only in the pipeline when
--tensor-parallel-size is above 1; it needs nothing, so it runs while model_prepare reads the model."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from glowplug.engine.distributed import TPGroup
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport


def current_traceparent() -> str | None:
    """The W3C traceparent of the span running now (this stage's): the workers' start-up spans hang under it."""
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(trace.get_current_span()))
    return carrier.get("traceparent")


class DistributedInit:
    name = "distributed_init"
    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ("parallel",)

    def run(self, ctx: EngineContext) -> StageReport:
        group = TPGroup.start(ctx.config, ctx.cache_root, ctx.device, current_traceparent())
        ctx.parallel = group
        return StageReport(
            attributes={
                Attr.RANK: group.rank,
                Attr.WORLD_SIZE: group.world_size,
                Attr.TP_BACKEND: group.backend,
                Attr.TP_JOIN_S: round(group.join_s, 6),
                **({Attr.TP_THREADS: group.threads} if group.threads is not None else {}),
                Attr.TP_LAUNCH: "spawned workers" if group.launch.spawner else "launched by torchrun (or RANK set)",
            }
        )
