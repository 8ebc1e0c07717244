"""`GET /startup/events`: the start-up and serving as server-sent events.

Events (the SSE `event:` field; `data:` is one JSON object):
  hello        first on every connection: {boot_id, model, config_hash, expected_phases, eta_basis, eta_phases,
               predicted_ready_s, resumed, history}, where history is the recent `metrics` ticks (oldest first)
               so charts open with the last minutes
  phase_start  {stage, start_s}                                   a stage span started
  phase_end    {stage, row, start_s, end_s, seconds, outcome, note}  a stage span ended; outcome ran|skipped|failed
  state        {state, reason, failed_stage, cause, elapsed_s, eta_s, eta_basis, predicted_ready_s, end_s, trace_id,
               phase_table_rows}
               the life-cycle state changed (phase_table_rows once READY, failed_stage/cause when FAILED; end_s:
               where the start-up span ended, once it has)
  metrics      about once a second: {t_unix, state, phase (every running stage, joined), running_phases,
               phase_elapsed_s, elapsed_s, now_s, eta_s, predicted_ready_s, eta_phases and expected_phases (while
               STARTING), eta_basis, running,
               waiting, kv_usage, kv_used_blocks, kv_total_blocks, tokens_per_s, prompt_tokens_per_s,
               ttft: {p50, p90, p99, n}, tpot: {...}, window_s}
Offsets (`*_s` of phases, `now_s`, `predicted_ready_s`) are seconds from the start-up's root span, which is process
creation under `glowplug serve` (see `timeline.py`); `elapsed_s` is on the same clock and, once READY, the phase
table's time to READY.

phase_* and state events form one ordered log per server process, with ids `<boot_id>:<seq>`. A new connection
gets the whole log replayed first, so it sees every phase event in order however late it connects; a reconnection
that sends `Last-Event-ID` of this boot gets only what it missed, one of another boot (the server restarted) gets
the whole new log. `metrics` ticks carry no id and are not replayed (hello's history stands in for them).
The stream ends after DRAINING/STOPPED, so it never holds up a shutdown; browsers reconnect on their own
(`retry: 1000`) and then reach the next server on the port.

Producers run on other threads (the span's thread, the state's thread); delivery hops onto the event loop with
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from .live_metrics import ServingSampler
from .state import EngineState, StateSnapshot

if TYPE_CHECKING:
    from .service import Service

log = structlog.get_logger("glowplug.lifecycle.events")

HELLO = "hello"
STATE = "state"
METRICS = "metrics"
RETRY_MS = 1000
KEEPALIVE_S = 15.0
TICK_S = 1.0
HISTORY_TICKS = 600  # ten minutes of charts for a page opened late
QUEUE_LIMIT = 4096  # a client this far behind is dropped; it reconnects and catches up from the log
_ENDING = frozenset({EngineState.DRAINING.value, EngineState.STOPPED.value})


def _json(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True)
class Event:
    kind: str
    data: dict[str, Any]
    seq: int | None = None  # None: not in the log (metrics ticks)
    boot_id: str = ""

    @property
    def id(self) -> str | None:
        return None if self.seq is None else f"{self.boot_id}:{self.seq}"

    def encode(self) -> bytes:
        lines = [f"event: {self.kind}"]
        if self.id is not None:
            lines.append(f"id: {self.id}")
        lines.append(f"data: {_json(self.data)}")
        return ("\n".join(lines) + "\n\n").encode()


@dataclass(eq=False)
class _Subscriber:
    after_seq: int  # the log events up to here were replayed; later duplicates are skipped
    queue: asyncio.Queue[Event | None] = field(default_factory=lambda: asyncio.Queue(QUEUE_LIMIT))


class StartupEvents:
    """The event log, its subscribers and the metrics tick of one service. `start()` / `stop()` on its event loop."""

    def __init__(self, service: Service, *, tick_s: float = TICK_S, history: int = HISTORY_TICKS) -> None:
        self._service = service
        self._tick_s = tick_s
        self.boot_id = uuid.uuid4().hex[:16]
        self._lock = threading.RLock()
        self._log: list[Event] = []
        self._subscribers: set[_Subscriber] = set()
        self._ticks: deque[dict[str, Any]] = deque(maxlen=history)
        self._sampler = ServingSampler(service.metrics.current, service.metrics.recent)
        self._last_state: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._progress = progress = service.progress
        self._unsubscribe: list[Callable[[], None]] = [
            progress.timeline.subscribe(self._append),
            progress.lifecycle.subscribe(self._state_changed),
        ]
        progress.on_restart(self.restart)
        self._state_changed(progress.snapshot())

    # ------------------------------------------------------------ life

    def start(self) -> None:
        """Begin ticking; call on the event loop that serves the streams."""
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._tick_forever(), name="glowplug-startup-events-tick")

    async def stop(self) -> None:
        """Stop ticking and end every open stream."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        with self._lock:
            subscribers, self._subscribers = list(self._subscribers), set()
        for sub in subscribers:
            self._close(sub)

    def restart(self) -> None:
        """A new start in this process (a restarted engine core): a new boot, so every page loads the new log."""
        with self._lock:
            self.boot_id = uuid.uuid4().hex[:16]
            self._log = []
            self._last_state = None
            subscribers, self._subscribers = list(self._subscribers), set()
        loop = self._loop
        for sub in subscribers:
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._close, sub)
        self._state_changed(self._progress.snapshot())

    # ------------------------------------------------------------ producing (any thread)

    def _append(self, kind: str, data: dict[str, Any]) -> None:
        # Appended and handed to the loop under one lock: events from two threads reach every stream in log order.
        with self._lock:
            event = Event(kind, data, seq=len(self._log) + 1, boot_id=self.boot_id)
            self._log.append(event)
            self._deliver(event)

    def _state_changed(self, snap: StateSnapshot) -> None:
        # The life cycle also reports every phase change; only the state itself is an event here (the phases
        # come from their spans). The data is read first: state_data takes other objects' locks.
        data = self.state_data(snap)
        with self._lock:
            if snap.state.value == self._last_state:
                return
            self._last_state = snap.state.value
            self._append(STATE, data)

    def state_data(self, snap: StateSnapshot) -> dict[str, Any]:
        progress = self._progress
        data: dict[str, Any] = {
            "state": snap.state.value,
            "reason": snap.reason,
            "failed_stage": None,
            "cause": None,
            "elapsed_s": progress.startup_total_s(snap),
            "eta_s": progress.eta_s(snap),
            "eta_basis": progress.eta_basis,
            "predicted_ready_s": progress.predicted_ready_s(snap),
            "end_s": progress.timeline.end_s(),
            "trace_id": None,
            "phase_table_rows": None,
        }
        if snap.state is EngineState.FAILED:
            failed = progress.timeline.failed_phase()
            if failed is not None:
                data["failed_stage"] = failed.stage
                data["cause"] = (failed.reason or "").removeprefix("failed: ") or snap.reason
            else:
                # Failed outside any stage span (the engine import, or the engine core after READY).
                last = snap.finished_phases[-1] if snap.finished_phases else None
                data["failed_stage"] = last.name if last is not None and last.failed else None
                data["cause"] = snap.reason
        table = progress.phase_table
        if table is not None and snap.state is not EngineState.STARTING:
            from glowplug.profiling.phases import display_rows

            data["trace_id"] = table.trace_id
            data["phase_table_rows"] = [vars(row) for row in display_rows(table)]
        return data

    def _deliver(self, event: Event | None) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # nobody can be subscribed yet; the log replays it
        try:
            loop.call_soon_threadsafe(self._fan_out, event)
        except RuntimeError:
            pass  # the loop closed between the check and the call

    def _fan_out(self, event: Event | None) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for sub in subscribers:
            if event is not None and event.seq is not None and event.seq <= sub.after_seq:
                continue  # already sent in this subscriber's replay
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:
                log.warning("event stream client too slow; dropping it (it reconnects and catches up)")
                with self._lock:
                    self._subscribers.discard(sub)
                self._close(sub)

    @staticmethod
    def _close(sub: _Subscriber) -> None:
        while not sub.queue.empty():
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)

    # ------------------------------------------------------------ ticks

    def tick(self) -> dict[str, Any]:
        """One `metrics` sample (also kept for hello's history)."""
        progress = self._progress
        snap = progress.snapshot()
        tick: dict[str, Any] = {
            "t_unix": time.time(),
            "state": snap.state.value,
            "phase": progress.phase_text(snap),
            "running_phases": progress.running_phases(snap),
            "phase_elapsed_s": snap.phase_elapsed_s if snap.phase else None,
            "elapsed_s": progress.startup_total_s(snap),
            "now_s": progress.timeline.now_s(),
            "eta_s": progress.eta_s(snap),
            "predicted_ready_s": progress.predicted_ready_s(snap),
            "eta_phases": progress.eta_phases() if snap.state is EngineState.STARTING else None,
            # Known only once the engine is imported (after hello, for a page opened early): the ghosts need it.
            "expected_phases": progress.expected_phase_seconds if snap.state is EngineState.STARTING else None,
            "eta_basis": progress.eta_basis,
            "ranks": progress.rank_progress(snap) if snap.state is EngineState.STARTING else None,
        }
        tick.update(self._sampler.sample())
        with self._lock:
            self._ticks.append(tick)
        return tick

    def latest_tick(self) -> dict[str, Any] | None:
        with self._lock:
            return self._ticks[-1] if self._ticks else None

    async def _tick_forever(self) -> None:
        while True:
            try:
                tick = self.tick()
            except Exception as exc:  # a broken sample must not end the stream for everyone
                log.warning("metrics tick failed", error=f"{type(exc).__name__}: {exc}")
            else:
                self._fan_out(Event(METRICS, tick))
            await asyncio.sleep(self._tick_s)

    # ------------------------------------------------------------ consuming (event loop)

    def hello(self, resumed: bool) -> dict[str, Any]:
        service = self._service
        with self._lock:
            history = list(self._ticks)
        return {
            "boot_id": self.boot_id,
            "model": service.model_name,
            "config_hash": service.config.compute_hash(),
            "expected_phases": self._progress.expected_phase_seconds,
            "eta_basis": self._progress.eta_basis,
            "eta_phases": self._progress.eta_phases(),
            "predicted_ready_s": self._progress.predicted_ready_s(),
            "resumed": resumed,
            "history": history,
        }

    def _resume_point(self, last_event_id: str | None) -> int | None:
        """The seq to resume after, when `last_event_id` names an event of this boot; else None (replay all)."""
        if not last_event_id:
            return None
        boot, _, seq = last_event_id.strip().partition(":")
        if boot != self.boot_id or not seq.isdigit():
            return None
        return int(seq)

    async def stream(self, last_event_id: str | None = None) -> AsyncIterator[bytes]:
        """The bytes of one SSE connection."""
        resume = self._resume_point(last_event_id)
        with self._lock:
            replay = [e for e in self._log if resume is None or (e.seq or 0) > resume]
            sub = _Subscriber(after_seq=len(self._log))
            self._subscribers.add(sub)
            state = self._last_state
        try:
            yield f"retry: {RETRY_MS}\n\n".encode()
            yield Event(HELLO, self.hello(resumed=resume is not None)).encode()
            for event in replay:
                yield event.encode()
            if state in _ENDING:
                return  # nothing more will happen on this server; don't hold the shutdown up
            while True:
                try:
                    event = await asyncio.wait_for(sub.queue.get(), KEEPALIVE_S)  # type: ignore[arg-type]
                except asyncio.TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if event is None:
                    return
                yield event.encode()
                if event.kind == STATE and event.data["state"] in _ENDING:
                    return
        finally:
            with self._lock:
                self._subscribers.discard(sub)

    def startup_extras(self) -> dict[str, Any]:
        """What `/startup` adds from here, for clients that poll: the boot id, the latest metrics tick, and the
        failing stage and its cause (the same as the `state` event's)."""
        state = self.state_data(self._progress.snapshot())
        return {
            "boot_id": self.boot_id,
            "failed_stage": state["failed_stage"],
            "cause": state["cause"],
            "live": self.latest_tick(),
        }
