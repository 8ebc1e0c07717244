"""One start in progress: its context, its start-up span and clock, and what its stages returned.

build_engine plans a start and hands the running to a StartRun: it opens the root span (tagged with the rank under
tensor parallelism), defers Python's full collections while the stages run, installs a bundle first and alone,
runs the pipeline, turns a failed stage into the one error the caller sees, and at READY runs the hooks of
engine/stages/ready.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode, Tracer

from glowplug.profiling.names import SCHEMA_VERSION, STARTUP_SPAN, Attr
from glowplug.profiling.process import Clock, FullGcDeferral, ProcessMarks, open_startup_span
from glowplug.profiling.tracing import RankAttributes, Tracing

from .config import EngineConfig
from .distributed import DistributedError, worker_trace_context
from .parallel import launch_rank
from .stages.bundle_install import BundleInstall
from .stages.context import EngineContext
from .stages.protocol import Stage, StageResult, StartupFailed
from .stages.ready import ReadyContext
from .stages.runner import run_in_order, run_stages
from .start_profile import StartPlan


@dataclass
class StartRun:
    """One start: `ctx` is the context the pipeline runs on (replaced once, after a bundle's install), `results`
    every stage that ran in order, `root` the start-up span, open until the phase_table hook ends it at READY."""

    ctx: EngineContext
    tracing: Tracing
    tracer: Tracer
    root: Span
    clock: Clock
    marks: ProcessMarks | None
    results: list[StageResult] = field(default_factory=list)

    @classmethod
    def open(
        cls, config: EngineConfig, cache_root: Path, tracing: Tracing, marks: ProcessMarks | None, parent: Any
    ) -> StartRun:
        """The context and the open root span (see build_engine for `marks` and `parent`)."""
        tracer = tracing.tracer()
        ctx = EngineContext(config=config, cache_root=cache_root, device=config.resolved_device())
        clock = marks.clock if marks is not None else Clock()
        # The root span is ours in both modes so that work after READY (the start-up profile, sealing the compile
        # cache) still has a span to report cache events on.
        if parent is not None:
            root = tracer.start_span(
                STARTUP_SPAN,
                start_time=clock.now_ns(),
                context=parent,
                attributes={Attr.SCHEMA_VERSION: SCHEMA_VERSION},
            )
        elif marks is not None:
            root = open_startup_span(tracer, marks)
        else:
            root = tracer.start_span(
                STARTUP_SPAN,
                start_time=clock.now_ns(),
                attributes={Attr.SCHEMA_VERSION: SCHEMA_VERSION},
                context=worker_trace_context(),
            )
        if config.tensor_parallel_size > 1:
            # Every rank's spans go into one trace (a worker's root hangs under rank 0's distributed_init): each
            # says which rank it is.
            root.set_attributes({Attr.RANK: launch_rank(), Attr.WORLD_SIZE: config.tensor_parallel_size})
            tracing.provider.add_span_processor(RankAttributes(launch_rank(), config.tensor_parallel_size))
        return cls(ctx, tracing, tracer, root, clock, marks)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Around the stages: full collections deferred (see FullGcDeferral; the process entry may have started one
        already, resumed here with a freeze once an engine exists), and a failed stage ending the root span with
        its error, named by the rank that died when a collective noticed another rank's death first."""
        deferral = FullGcDeferral.start()
        try:
            yield
        except StartupFailed as failed:
            if self.ctx.parallel is not None:
                # A rank that died shows here as whatever collective noticed first: name the rank instead.
                rank_failure = self.ctx.parallel.failure()
                self.ctx.parallel.close()
                if rank_failure is not None:
                    failed = StartupFailed(failed.stage, DistributedError(rank_failure))
            self.root.set_status(Status(StatusCode.ERROR, str(failed)))
            self.root.set_attribute(Attr.ERROR, str(failed))
            self.root.end(end_time=self.clock.now_ns())
            raise failed from failed.cause
        finally:
            deferral.resume()
            if self.marks is not None and self.marks.gc_deferral is not None:
                self.marks.gc_deferral.resume(freeze=self.ctx.engine is not None)

    def run(
        self, stages: Sequence[Stage], on_phase: Callable[[str], None] | None, ctx: EngineContext | None = None
    ) -> None:
        """Run `stages` under the root span on `ctx` (default: this start's context); their results join the run's."""
        self.results += run_stages(
            stages,
            ctx if ctx is not None else self.ctx,
            tracer=self.tracer,
            on_phase=on_phase,
            parent=self.root,
            clock=self.clock,
        )

    def install_bundle(self, on_phase: Callable[[str], None] | None) -> None:
        """The config's bundle, installed first and alone (the plan's cache probes and the stages must see what it
        installs); the pipeline then runs on a fresh context with the model the bundle brought."""
        first = EngineContext(config=self.ctx.config, cache_root=self.ctx.cache_root, device=self.ctx.device)
        self.run([BundleInstall()], on_phase, first)
        config = self.ctx.config.model_copy(update={"model": first.bundle.model})
        self.ctx = EngineContext(config=config, cache_root=self.ctx.cache_root, device=self.ctx.device)

    def ready(self, plan: StartPlan, hooks: Sequence[Stage]) -> ReadyContext:
        """READY: take its time, then run the `hooks` (engine/stages/ready.py) on what the start left."""
        ready_ns = self.clock.now_ns()
        ctx = self.ctx
        assert ctx.engine is not None, "the pipeline ended without building an engine (is kv_cache_init in it?)"
        assert ctx.kv_plan is not None and ctx.arch is not None and ctx.model_dir is not None
        at = ReadyContext(
            config=ctx.config,
            cache_root=ctx.cache_root,
            plan=plan,
            marks=self.marks,
            clock=self.clock,
            root=self.root,
            tracing=self.tracing,
            results=self.results,
            ready_ns=ready_ns,
            engine=ctx.engine,
            weights_bytes=ctx.weights_bytes,
            compile_cache=ctx.compile_cache,
            parallel=ctx.parallel,
        )
        run_in_order(hooks, at)
        assert at.table is not None, "the hooks at READY built no phase table (is phase_table among them?)"
        return at
