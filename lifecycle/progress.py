"""The start-up as the server shows it: the life-cycle state, the phases (from spans), the ETA and the phase table.

The one owner of everything `/startup`, `/health/ready`, the live page, its event stream and the terminal read
about a start. The engine runs in its own process (engine/core_proc.py) and sends its start-up spans as they
start and end; this object takes them (`span_started` / `span_ended`) and hands them to the same readers a span
of this process would reach: the live timeline (lifecycle/timeline.py), the terminal's progress lines
(profiling/progress.py) and the in-memory trace the downloads export. The server opens the trace's root span
(`begin`), so the server's own pre-main rows and the core's stages are one trace; the core passes it on at spawn.

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

from glowplug.engine.core_frames import Planned, SpanRecord, record_to_span, span_to_record
from glowplug.engine.tp_progress import read_progress
from glowplug.profiling.names import IMPORTS, PRE_MAIN, SCHEMA_VERSION, STAGE_ROWS, STARTUP_SPAN, Attr
from glowplug.profiling.process import ProcessMarks, open_startup_span
from glowplug.profiling.tracing import Tracing

from .state import EngineState, Lifecycle, StateSnapshot, estimate_remaining
from .timeline import StartupTimeline

if TYPE_CHECKING:
    from glowplug.profiling.phases import PhaseTable
    from glowplug.profiling.progress import StartupProgress

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
    def __init__(self, tracing: Tracing, *, marks: ProcessMarks | None = None,
                 display: StartupProgress | None = None, world_size: int = 1) -> None:  # fmt: skip
        self.tracing = tracing
        self.lifecycle = Lifecycle()
        self._marks = marks
        self._display = display
        self._opening = False
        self.timeline = StartupTimeline(accept=lambda: self._opening,
                                        origin_ns=marks.process_start_ns if marks is not None else None)  # fmt: skip
        tracing.provider.add_span_processor(self.timeline)
        self._root: Any = None
        self._expected: dict[str, float] | None = None
        self._eta_basis: str | None = None
        self._eta_scale = 1.0
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
        pre = [span_to_record(s) for s in self.tracing.finished_spans()
               if s.context is not None and s.context.trace_id == trace_id]  # fmt: skip
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

    def planned(self, plan: Planned) -> None:
        self._eta_basis = plan.basis
        if plan.expected:
            self._expected = dict(plan.expected)
            self._eta_scale = float(plan.scale)
        display = self._display
        if display is not None:
            if not self._planned and self._marks is not None:
                seconds = (plan.imports_done_ns - self._marks.main_entry_ns) / 1e9
                display.imports_done(seconds, plan.expected, plan.same_config, plan.basis, plan.total_s)
            else:
                display.plan_known(plan.expected, plan.same_config, plan.basis, plan.total_s)
        self._planned = True

    def ready(self, table: PhaseTable | None, ready_ns: int) -> bool:
        """READY: end the root span there; False when the start-up was overtaken (a drain began meanwhile)."""
        self.phase_table = table
        if self._root is not None:
            self._root.end(end_time=ready_ns)
            self._root = None
        if self._display is not None:
            self._display.close(ready_s=table.actual_total_time if table is not None else None)
        return self.lifecycle.mark_ready()

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
        return estimate_remaining(snap or self.snapshot(), self._expected, self._eta_scale)

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
            {"name": p.name, "stage": p.name, "seconds": _round6(p.seconds), "failed": p.failed, "running": False,
             "outcome": "failed" if p.failed else "ran"}
            for p in snap.finished_phases
            if p.name in PRE_MAIN and p.name not in spans
        ]
        entries = [(p["start_s"], {"name": p["row"], "stage": p["stage"], "seconds": _round6(p["seconds"]),
                                   "failed": p["outcome"] == "failed", "running": False, "outcome": p["outcome"]})
                   for p in timeline["phases"]]  # fmt: skip
        now = self.timeline.now_s()
        entries += [(p["start_s"], {"name": STAGE_ROWS.get(p["stage"], p["stage"]), "stage": p["stage"],
                                    "seconds": _round6(max(0.0, (now or p["start_s"]) - p["start_s"])),
                                    "failed": False, "running": True, "outcome": "running"})
                    for p in timeline["running"]]  # fmt: skip
        return out + [entry for _, entry in sorted(entries, key=lambda e: e[0])]

    def rank_progress(self, snap: StateSnapshot | None = None) -> list[dict[str, Any]] | None:
        """Under tensor parallelism, every rank's stage: `rank`, `stage` (what it runs now, None before its first),
        `state` (starting, running, ready, failed). Rank 0 is the engine core: its stages are the running phases.
        None for one rank."""
        if self.world_size <= 1 or self.tp_rundir is None:
            return None
        ranks = read_progress(self.tp_rundir, self.world_size)
        snap = snap or self.snapshot()
        running = [p["stage"] for p in self.timeline.snapshot()["running"]]
        ranks[0].update(stage=", ".join(running) or snap.phase, state=snap.state.value)
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
