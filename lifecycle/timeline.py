"""The start-up as it happens, read from its spans: a span processor on the start-up's tracer provider that sees
each `glowplug.startup.<stage>` span start and end.

This is the live view of the same record the phase table is built from: a finished phase here is
`profiling.phases.span_phase(span)`, the very function `build_phase_table` books rows with, and its times are the
span's own start and end. So the start-up page, `/startup/events` and `/startup` can never show a number that the
CLI table contradicts; nothing here keeps a timer of its own.

Offsets are seconds from the start of the root `glowplug.startup` span, which is process creation when the
process marks were taken (`glowplug serve`) and the pipeline's start otherwise. Concurrent stages simply have
overlapping [start, end) intervals; nothing here assumes the stages run one after another.

Span processor callbacks run on the thread that starts or ends the span (the start-up thread); readers call
`snapshot()` from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import format_trace_id

from glowplug.profiling.names import STARTUP_SPAN, stage_from_span_name
from glowplug.profiling.phases import SpanPhase, span_phase

from .subscribers import Subscribers

PhaseListener = Callable[[str, dict[str, Any]], None]  # (event kind, data)

PHASE_START = "phase_start"
PHASE_END = "phase_end"


def _seconds(nanos: int) -> float:
    return round(nanos / 1e9, 9)


class StartupTimeline(SpanProcessor):
    """Phases started and finished so far by one start-up; listeners get `phase_start` / `phase_end` events.

    accept: called on the thread that opens a root `glowplug.startup` span; the first root span it accepts binds
        the timeline to that span's trace (a provider shared by several services, as in tests, holds several).
    """

    def __init__(self, *, accept: Callable[[], bool] | None = None, origin_ns: int | None = None) -> None:
        self._accept = accept
        self._lock = threading.Lock()
        self._trace_id: int | None = None
        self._origin_ns = origin_ns
        self._end_ns: int | None = None
        self._running: dict[str, int] = {}  # stage -> span start (ns); insertion order is start order
        self._finished: list[SpanPhase] = []  # in the order the spans ended
        self._listeners: Subscribers[PhaseListener] = Subscribers()

    def reset(self) -> None:
        """Forget this start: the next root span accepted binds the timeline to a new trace (a restarted core)."""
        with self._lock:
            self._trace_id = None
            self._origin_ns = None
            self._end_ns = None
            self._running.clear()
            self._finished.clear()

    def subscribe(self, listener: PhaseListener) -> Callable[[], None]:
        """Call `listener(kind, data)` after each phase start and end (on the span's thread)."""
        return self._listeners.subscribe(listener)

    # ------------------------------------------------------------ SpanProcessor

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if not span.name.startswith(STARTUP_SPAN):
            return
        trace_id = span.get_span_context().trace_id
        with self._lock:
            if self._trace_id is None:
                if span.name != STARTUP_SPAN or (self._accept is not None and not self._accept()):
                    return
                self._trace_id = trace_id
                self._origin_ns = span.start_time
                return
            stage = stage_from_span_name(span.name)
            if trace_id != self._trace_id or stage is None or span.start_time is None:
                return
            self._running[stage] = span.start_time
            data = self._started_locked(stage, span.start_time)
            listeners = self._listeners.snapshot()
        for listener in listeners:
            listener(PHASE_START, data)

    def on_end(self, span: ReadableSpan) -> None:
        if not span.name.startswith(STARTUP_SPAN) or span.context is None:
            return
        with self._lock:
            if self._trace_id is None or span.context.trace_id != self._trace_id:
                return
            if span.name == STARTUP_SPAN:
                self._end_ns = span.end_time
                return
            phase = span_phase(span)
            self._running.pop(phase.stage, None)
            self._finished.append(phase)
            data = self._finished_locked(phase)
            listeners = self._listeners.snapshot()
        for listener in listeners:
            listener(PHASE_END, data)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    # ------------------------------------------------------------ reading

    @property
    def trace_id(self) -> int | None:
        with self._lock:
            return self._trace_id

    def finished(self) -> tuple[SpanPhase, ...]:
        with self._lock:
            return tuple(self._finished)

    def failed_phase(self) -> SpanPhase | None:
        """The stage span that ended with an error, if any (the last one)."""
        with self._lock:
            return next((p for p in reversed(self._finished) if p.outcome == "failed"), None)

    def end_s(self) -> float | None:
        """Where the root start-up span ended (READY, or the failure), once it has."""
        with self._lock:
            return None if self._end_ns is None else self._offset_locked(self._end_ns)

    def now_s(self) -> float | None:
        """Seconds from the origin to now, on the spans' time line; None before the start-up span exists."""
        with self._lock:
            origin = self._origin_ns
        return None if origin is None else _seconds(time.time_ns() - origin)

    def snapshot(self) -> dict[str, Any]:
        """Everything so far: `phases` (finished, in end order) and `running` (started, not yet ended)."""
        with self._lock:
            return {
                "origin_unix_ns": self._origin_ns,
                "trace_id": None if self._trace_id is None else format_trace_id(self._trace_id),
                "end_s": None if self._end_ns is None else self._offset_locked(self._end_ns),
                "phases": [self._finished_locked(p) for p in self._finished],
                "running": [self._started_locked(s, t) for s, t in self._running.items()],
            }

    # ------------------------------------------------------------ internals (lock held)

    def _offset_locked(self, ns: int) -> float:
        return _seconds(ns - (self._origin_ns or ns))

    def _started_locked(self, stage: str, start_ns: int) -> dict[str, Any]:
        return {"stage": stage, "start_s": self._offset_locked(start_ns)}

    def _finished_locked(self, phase: SpanPhase) -> dict[str, Any]:
        return {
            "stage": phase.stage,
            "row": phase.row,
            "start_s": self._offset_locked(phase.start_ns),
            "end_s": self._offset_locked(phase.end_ns),
            "seconds": phase.nanos / 1e9,  # exactly PhaseRow.seconds of a one-span row
            "outcome": phase.outcome,
            "note": phase.note,
        }
