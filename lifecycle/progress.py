"""The start-up as the server shows it: the life-cycle state, the phases (from spans), the ETA and the phase table.

The one owner of everything `/startup`, `/health/ready`, the live page, its event stream and the terminal read
about a start. The engine runs in its own process (engine/core_proc.py) and sends its start-up spans as they
start and end; this object takes them (`span_started` / `span_ended`) and hands them to the same readers a span
of this process would reach: the live timeline (lifecycle/timeline.py), the terminal's progress lines
(profiling/progress.py) and the in-memory trace the downloads export. The server opens the trace's root span
(`begin`), so the server's own pre-main rows and the core's stages are one trace; the core passes it on at spawn.

The ETA and the predicted READY time are this object's too. Before it starts a core, the server predicts the start
without torch (`predict_early`: engine/start_profile.py `predict_before_start`), so `/startup` has a predicted READY
time and its basis from the first second; the core's own plan, made after its imports with every cache probe,
replaces it (`planned`: the Planned frame carries the engine's PhaseEstimate as plain data: seconds per stage,
where each comes from, the pipeline's waits). While stages run, the ETA is the critical path of what is left
(`PhaseEstimate.remaining_s`), so every running stage counts and one that overruns its estimate keeps it growing.
The total time to READY is the phase table's (`actual_total_time`, sent with READY), the same number everywhere.

Everything here runs on the server's event loop (the core client receives the frames there); readers on other
threads see state through the thread-safe Lifecycle and timeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from glowplug.engine.config import EngineConfig
from glowplug.engine.core_frames import Planned, SpanRecord, record_to_span, span_to_record
from glowplug.engine.start_estimate import OVERRUN_SHARE, PhaseEstimate
from glowplug.engine.tp_progress import read_progress
from glowplug.profiling.names import IMPORTS, PRE_MAIN, SCHEMA_VERSION, STAGE_ROWS, STARTUP_SPAN, Attr
from glowplug.profiling.process import ProcessMarks, open_startup_span
from glowplug.profiling.tracing import Tracing

from .state import EngineState, Lifecycle, StateSnapshot, estimate_remaining
from .timeline import StartupTimeline

if TYPE_CHECKING:
    from glowplug.profiling.phases import PhaseTable
    from glowplug.profiling.progress import StartupProgress

    from .metrics import ServiceMetrics

log = structlog.get_logger("glowplug.lifecycle.progress")


def _round6(value: float) -> float:
    return round(value, 6)


@dataclass(frozen=True)
class TraceStart:
    """What a core needs to join the start's trace: the root's traceparent and the server's finished pre-main
    spans (the phase table the core builds at READY includes them)."""

    traceparent: str | None
    pre_spans: list[SpanRecord]
    origin_ns: int | None  # the server's process creation, when its marks were taken


class Progress:
    def __init__(
        self,
        tracing: Tracing,
        *,
        marks: ProcessMarks | None = None,
        display: StartupProgress | None = None,
        world_size: int = 1,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        """metrics: where the predicted-READY gauge goes (`refresh_prediction`), when there is a registry."""
        self.tracing = tracing
        self._metrics = metrics
        self.lifecycle = Lifecycle()
        self._marks = marks
        self._display = display
        self._opening = False
        self.timeline = StartupTimeline(
            accept=lambda: self._opening, origin_ns=marks.process_start_ns if marks is not None else None
        )
        tracing.provider.add_span_processor(self.timeline)
        self._root: Any = None
        self._expected: dict[str, float] | None = None
        self._eta_basis: str | None = None
        self._eta_scale = 1.0
        self._estimate: PhaseEstimate | None = None  # the latest plan's
        self._first_predicted_s: float | None = None  # the first predicted READY (seconds from the origin)
        self._planned = False
        self.phase_table: PhaseTable | None = None
        self.world_size = world_size
        self.tp_rundir: Path | None = None  # set by the core client under tensor parallelism
        self.boot = 0  # starts so far in this process (a restarted core is a new start)
        self._restart_listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------ the trace

    def begin(self) -> TraceStart:
        """Open this start's root span (from the process's creation for the first start, with marks; from now for
        a restarted core) and say how a core joins it."""
        tracer = self.tracing.tracer()
        self._opening = True
        try:
            if self._marks is not None and self.boot == 0:
                self._marks.mark_imports_done()  # the server's own imports: done before it starts a core
                self._root = open_startup_span(tracer, self._marks)
            else:
                self._root = tracer.start_span(STARTUP_SPAN, attributes={Attr.SCHEMA_VERSION: SCHEMA_VERSION})
        finally:
            self._opening = False
        self.boot += 1
        self.lifecycle.enter_phase(IMPORTS)
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(self._root))
        trace_id = self._root.get_span_context().trace_id
        pre = [
            span_to_record(s)
            for s in self.tracing.finished_spans()
            if s.context is not None and s.context.trace_id == trace_id
        ]
        origin = self._marks.process_start_ns if self._marks is not None and self.boot == 1 else None
        return TraceStart(carrier.get("traceparent"), pre, origin)

    @property
    def display(self) -> StartupProgress | None:
        """The terminal's progress lines, when `glowplug serve` shows them."""
        return self._display

    def restart(self) -> None:
        """A new start in this process (the core is restarted): STARTING again, a new trace, a new event log."""
        self.lifecycle.restart()
        self.timeline.reset()
        self.phase_table = None
        self._expected, self._eta_basis, self._eta_scale, self._planned = None, None, 1.0, False
        self._estimate, self._first_predicted_s = None, None
        for listener in list(self._restart_listeners):
            listener()

    def on_restart(self, listener: Callable[[], None]) -> None:
        self._restart_listeners.append(listener)

    # ------------------------------------------------------------ what the core sends

    def span_started(self, record: SpanRecord) -> None:
        span = record_to_span(record)
        self.timeline.on_start(span)  # type: ignore[arg-type]
        if self._display is not None:
            self._display.on_start(span)  # type: ignore[arg-type]

    def span_ended(self, record: SpanRecord, live: bool = True) -> None:
        span = record_to_span(record)
        if live:
            self.timeline.on_end(span)
            if self._display is not None:
                self._display.on_end(span)
        self.tracing.add_finished([span])

    def phase_entered(self, name: str) -> None:
        self.lifecycle.enter_phase(name)

    def predict_early(self, config: EngineConfig, *, skip: bool = False) -> None:
        """The prediction made before the core is started (module docstring): no torch, no weight read. A failure
        costs only this early ETA; `skip`: make none (an injected engine factory with a bundle, whose plan needs
        the bundle installed)."""
        if skip:
            return
        try:
            from glowplug.base.artifacts.cachedir import cache_dir_from_env
            from glowplug.engine.start_profile import predict_before_start

            plan = predict_before_start(config, cache_dir_from_env())
        except Exception as exc:  # noqa: BLE001 - the core's own plan follows after its imports
            log.info("no early start-up prediction", error=f"{type(exc).__name__}: {exc}")
            return
        if plan.estimate is not None and plan.estimate.seconds:
            self._take_plan(plan.basis, plan.estimate)

    def planned(self, plan: Planned) -> None:
        """The core's plan (after its imports, or once a bundle is installed): it replaces the early one."""
        self._take_plan(plan.basis, plan.estimate)
        display = self._display
        if display is not None:
            if not self._planned and self._marks is not None:
                imports_s = (plan.imports_done_ns - self._marks.main_entry_ns) / 1e9
                display.imports_done(imports_s, plan.estimate, plan.basis)
            else:
                display.plan_known(plan.estimate, plan.basis)
        self._planned = True

    def _take_plan(self, basis: str | None, estimate: PhaseEstimate | None) -> None:
        """Take a plan's ETA fields; the first prediction is kept for the gauge and /startup."""
        self._eta_basis = basis
        if estimate is not None and estimate.seconds:
            self._expected = {str(k): float(v) for k, v in estimate.seconds.items()}
            self._eta_scale = float(estimate.scale)
            self._estimate = estimate
        predicted = self.predicted_ready_s()
        if predicted is not None and self._first_predicted_s is None:
            self._first_predicted_s = predicted
        self.refresh_prediction()

    def ready(self, table: PhaseTable | None, ready_ns: int) -> bool:
        """READY: end the root span there; False when the start-up was overtaken (a drain began meanwhile)."""
        self.phase_table = table
        if self._root is not None:
            self._root.end(end_time=ready_ns)
            self._root = None
        if self._display is not None:
            self._display.close(ready_s=table.actual_total_time if table is not None else None)
        ready = self.lifecycle.mark_ready()
        self.refresh_prediction()
        return ready

    def failed(self, reason: str) -> bool:
        """FAILED(reason): the start failed, or the core died; False when already stopped or failed."""
        if self._root is not None:
            self._root.set_status(Status(StatusCode.ERROR, reason))
            self._root.set_attribute(Attr.ERROR, reason)
            self._root.end()
            self._root = None
        if self._display is not None:
            self._display.close()
        return self.lifecycle.mark_failed(reason)

    def close(self) -> None:
        if self._root is not None:
            self._root.end()
            self._root = None
        if self._display is not None:
            self._display.close()

    # ------------------------------------------------------------ reading

    def snapshot(self) -> StateSnapshot:
        return self.lifecycle.snapshot()

    def eta_s(self, snap: StateSnapshot | None = None) -> float | None:
        """Seconds until READY: 0 once READY, None when unknown or not starting. From the plan's estimate
        (engine/start_estimate.py `remaining_s`) over the stages finished and running now, by their spans, so
        stages that run at once are all counted and one that overruns its estimate keeps the ETA growing; before
        the first stage, the early plan's engine imports less what has passed, plus the stages."""
        snap = snap or self.snapshot()
        if snap.state is EngineState.READY:
            return 0.0
        if snap.state is not EngineState.STARTING:
            return None
        estimate = self._estimate
        if estimate is None:
            return estimate_remaining(snap, self._expected, self._eta_scale)
        timeline = self.timeline.snapshot()
        stages = [p for p in timeline["phases"] if p["stage"] not in PRE_MAIN]
        if not stages and not timeline["running"]:
            importing = snap.phase == IMPORTS and estimate.imports_s is not None
            e = snap.phase_elapsed_s
            rest = max(estimate.imports_s - e, OVERRUN_SHARE * e) if importing else 0.0  # type: ignore[operator]
            return rest + estimate.total_s
        elapsed = self.startup_now_s(snap)
        finished = {p["stage"] for p in stages}
        running = {p["stage"]: max(0.0, elapsed - p["start_s"]) for p in timeline["running"]}
        return float(estimate.remaining_s(finished, running))

    def startup_now_s(self, snap: StateSnapshot | None = None) -> float:
        """Seconds into the start: from process creation when the process marks were taken (the phase table's
        origin), else from the start-up span's start."""
        now = self.timeline.now_s()
        return now if now is not None else (snap or self.snapshot()).startup_elapsed_s

    def startup_total_s(self, snap: StateSnapshot | None = None) -> float:
        """The one time to READY every place shows (the log line, /startup, the page): the phase table's
        actual_total_time once the core sent it, else the start-up span's end, else the time so far."""
        table = self.phase_table
        if table is not None and table.actual_total_time is not None:
            return float(table.actual_total_time)
        end = self.timeline.end_s()
        return end if end is not None else self.startup_now_s(snap)

    def predicted_ready_s(self, snap: StateSnapshot | None = None) -> float | None:
        """The predicted time to READY, seconds from the origin (`startup_now_s`): now + the ETA while starting,
        the first prediction once READY; None without one."""
        snap = snap or self.snapshot()
        if snap.state is not EngineState.STARTING:
            return self._first_predicted_s
        eta = self.eta_s(snap)
        return None if eta is None else self.startup_now_s(snap) + eta

    @property
    def first_predicted_ready_s(self) -> float | None:
        """The first prediction of this start (before the core's imports when the start-up profile allowed)."""
        return self._first_predicted_s

    def refresh_prediction(self) -> None:
        """Set the predicted-READY gauge (the latest prediction while starting, the actual time once READY)."""
        if self._metrics is None:
            return
        snap = self.snapshot()
        if snap.state is EngineState.STARTING:
            self._metrics.set_startup_predicted(first=self._first_predicted_s, latest=self.predicted_ready_s(snap))
        elif snap.state is EngineState.READY:
            self._metrics.set_startup_predicted(first=self._first_predicted_s, latest=self.startup_total_s(snap))

    def running_phases(self, snap: StateSnapshot | None = None) -> list[str]:
        """Every stage running now, in the order they began (stages run at once); before the first stage span
        (the imports) the life cycle's phase. Empty once no longer starting."""
        snap = snap or self.snapshot()
        if snap.state is not EngineState.STARTING:
            return []
        running = sorted(self.timeline.snapshot()["running"], key=lambda p: p["start_s"])
        names = [p["stage"] for p in running]
        return names or ([snap.phase] if snap.phase else [])

    def phase_text(self, snap: StateSnapshot | None = None) -> str | None:
        """The running stages as one string ("load_weights, tokenizer_init"), for fields that held one phase."""
        return ", ".join(self.running_phases(snap)) or None

    def eta_phases(self) -> dict[str, dict[str, Any]] | None:
        """stage -> {seconds, kind, basis, inputs}: the current plan per phase (`PhaseEstimate.phases_json`), None
        without a plan."""
        return None if self._estimate is None else self._estimate.phases_json()

    @property
    def expected_phase_seconds(self) -> dict[str, float] | None:
        """Seconds per stage this start should take (from the last start with the same cache hits, see
        engine/start_estimate.py); None until the core has planned its start, or without a profile."""
        return self._expected

    @property
    def eta_basis(self) -> str | None:
        """What the ETA comes from, in words (the page, /startup and the events show it beside the ETA)."""
        return self._eta_basis

    def phases_so_far(self, snap: StateSnapshot | None = None) -> list[dict[str, Any]]:
        """The phases so far, by start: `name` is the phase table's row (the name /metrics uses too), `stage` the
        stage that ran, `outcome` ran, skipped (the table books it no time), failed or running. A finished phase has
        its span's seconds (the table's number for a phase that ran); a running one has the seconds elapsed so far
        and `running: true`, never the instant the life cycle saw it begin. The life cycle's own timing is only for
        what has no span (the engine import when no process marks were taken)."""
        snap = snap or self.snapshot()
        timeline = self.timeline.snapshot()
        spans = {p["stage"] for p in timeline["phases"]} | {p["stage"] for p in timeline["running"]}
        out: list[dict[str, Any]] = [
            {
                "name": p.name,
                "stage": p.name,
                "seconds": _round6(p.seconds),
                "failed": p.failed,
                "running": False,
                "outcome": "failed" if p.failed else "ran",
            }
            for p in snap.finished_phases
            if p.name in PRE_MAIN and p.name not in spans
        ]
        entries = [
            (
                p["start_s"],
                {
                    "name": p["row"],
                    "stage": p["stage"],
                    "seconds": _round6(p["seconds"]),
                    "failed": p["outcome"] == "failed",
                    "running": False,
                    "outcome": p["outcome"],
                },
            )
            for p in timeline["phases"]
        ]
        now = self.timeline.now_s()
        entries += [
            (
                p["start_s"],
                {
                    "name": STAGE_ROWS.get(p["stage"], p["stage"]),
                    "stage": p["stage"],
                    "seconds": _round6(max(0.0, (now or p["start_s"]) - p["start_s"])),
                    "failed": False,
                    "running": True,
                    "outcome": "running",
                },
            )
            for p in timeline["running"]
        ]
        return out + [entry for _, entry in sorted(entries, key=lambda e: e[0])]

    def rank_progress(self, snap: StateSnapshot | None = None) -> list[dict[str, Any]] | None:
        """Under tensor parallelism, every rank's stage: `rank`, `stage` (what it runs now, None before its first),
        `state` (starting, running, ready, failed). Rank 0 is the engine core: its stages are the running phases.
        None for one rank."""
        if self.world_size <= 1 or self.tp_rundir is None:
            return None
        ranks = read_progress(self.tp_rundir, self.world_size)
        snap = snap or self.snapshot()
        ranks[0].update(stage=self.phase_text(snap), state=snap.state.value)
        return [{k: r.get(k) for k in ("rank", "stage", "state")} for r in ranks]

    def phase_row_seconds(self, snap: StateSnapshot | None = None) -> dict[str, float]:
        """Seconds per phase-table row of the phases that finished: each stage span's time under the row the table
        books it to (graph_capture -> graph_capturing, summed when two stages share a row), plus the pre-main
        phases the service timed itself (the engine import, when no process marks were taken). One name per
        phase, the table's, so /metrics and /startup never list a phase twice under two names."""
        out: dict[str, float] = {}
        for phase in self.timeline.finished():
            if phase.booked_nanos is not None:
                out[phase.row] = out.get(phase.row, 0.0) + phase.booked_nanos / 1e9
        for timing in (snap or self.snapshot()).finished_phases:
            if timing.name in PRE_MAIN and timing.name not in out:
                out[timing.name] = timing.seconds
        return out

    def table_seconds(self) -> dict[str, float]:
        """Leaf rows (with a time) of the phase table, once there is one; else empty."""
        table = self.phase_table
        if table is None:
            return {}
        return {r.name: r.seconds for r in table.rows if r.kind == "leaf" and r.seconds is not None}

    def is_starting(self) -> bool:
        return self.snapshot().state is EngineState.STARTING
