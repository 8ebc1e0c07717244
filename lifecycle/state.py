"""The engine's life cycle as the service sees it: STARTING(phase) -> READY -> DRAINING -> STOPPED, or FAILED(reason).

The engine core's frames (read on the event loop) and the server's own signals move the state, and readers on any
thread look at it, so every change goes through one lock and observers get an immutable snapshot. Phase timings are
taken here from the phases the core enters (`enter_phase`: a phase ends when the next one starts, the last one at
READY), which makes `/startup` work while the start-up is still running, before any phase table exists. A core
that dies after READY turns the state FAILED; a restarted one (`restart`) starts it over at STARTING.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from glowplug.profiling.names import PRE_MAIN

from .subscribers import Subscribers


class EngineState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


# Which states may follow which. DRAINING may start during STARTING (a signal mid start-up); FAILED may follow READY
# (the engine core died) and DRAINING (it died while draining); STARTING may follow FAILED (a restarted core).
_ALLOWED: dict[EngineState, frozenset[EngineState]] = {
    EngineState.STARTING: frozenset({EngineState.READY, EngineState.FAILED, EngineState.DRAINING}),
    EngineState.READY: frozenset({EngineState.DRAINING, EngineState.FAILED}),
    EngineState.DRAINING: frozenset({EngineState.STOPPED, EngineState.FAILED}),
    EngineState.FAILED: frozenset({EngineState.STOPPED, EngineState.STARTING}),
    EngineState.STOPPED: frozenset(),
}


class InvalidTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class PhaseTiming:
    name: str
    seconds: float
    failed: bool = False


@dataclass(frozen=True)
class StateSnapshot:
    state: EngineState
    phase: str | None  # the running start-up phase (STARTING only)
    reason: str | None  # why FAILED
    finished_phases: tuple[PhaseTiming, ...]
    phase_elapsed_s: float  # time spent in `phase` so far
    startup_elapsed_s: float  # since the service began starting (frozen at READY/FAILED)
    ready_at: float | None  # monotonic time of READY

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    def phase_seconds(self) -> dict[str, float]:
        return {p.name: p.seconds for p in self.finished_phases}


class Lifecycle:
    """Thread-safe holder of the state; `subscribe` callbacks run on the thread that made the change."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._state = EngineState.STARTING
        self._phase: str | None = None
        self._phase_start = clock()
        self._started = self._phase_start
        self._ended: float | None = None
        self._ready_at: float | None = None
        self._reason: str | None = None
        self._finished: list[PhaseTiming] = []
        self._listeners: Subscribers[Callable[[StateSnapshot], None]] = Subscribers()

    def subscribe(self, listener: Callable[[StateSnapshot], None]) -> Callable[[], None]:
        """Call `listener` after every change; returns the unsubscribe function."""
        return self._listeners.subscribe(listener)

    def snapshot(self) -> StateSnapshot:
        with self._lock:
            return self._snapshot_locked(self._clock())

    @property
    def state(self) -> EngineState:
        with self._lock:
            return self._state

    def enter_phase(self, name: str) -> None:
        """The start-up moved on to phase `name` (the `on_phase` callback); ignored once no longer STARTING."""
        self._change(lambda now: self._enter_locked(name, now))

    def mark_ready(self) -> bool:
        """STARTING -> READY; False when the start-up was overtaken (a drain began meanwhile)."""
        return self._change(lambda now: self._finish_startup_locked(EngineState.READY, None, now))

    def mark_failed(self, reason: str) -> bool:
        """-> FAILED(reason) from STARTING, READY or DRAINING; False (and no change) once STOPPED or FAILED."""
        return self._change(lambda now: self._finish_startup_locked(EngineState.FAILED, reason, now))

    def begin_drain(self) -> bool:
        """READY/STARTING -> DRAINING; False when there is nothing to drain (already draining, failed, stopped)."""
        with self._lock:
            if self._state not in (EngineState.READY, EngineState.STARTING):
                return False
        self._change(lambda now: self._move_locked(EngineState.DRAINING, now))
        return True

    def restart(self) -> bool:
        """FAILED -> STARTING with a clean slate (a new engine core starts); False from any other state."""

        def move(now: float) -> bool:
            if self._state is not EngineState.FAILED:
                return False
            self._state = EngineState.STARTING
            self._phase, self._phase_start, self._started = None, now, now
            self._ended = self._ready_at = self._reason = None
            self._finished = []
            return True

        return self._change(move)

    def mark_stopped(self) -> None:
        self._change(lambda now: self._move_locked(EngineState.STOPPED, now))

    # ------------------------------------------------------------ internals (call with the lock held)

    def _change(self, mutate: Callable[[float], bool]) -> bool:
        with self._lock:
            changed = mutate(self._clock())
            snap = self._snapshot_locked(self._clock())
            listeners = self._listeners.snapshot()
        # Outside the lock: a listener may read the state again.
        if changed:
            for listener in listeners:
                listener(snap)
        return changed

    def _close_phase_locked(self, now: float, failed: bool = False) -> None:
        if self._phase is not None:
            self._finished.append(PhaseTiming(self._phase, now - self._phase_start, failed))
            self._phase = None

    def _enter_locked(self, name: str, now: float) -> bool:
        if self._state is not EngineState.STARTING:
            return False
        self._close_phase_locked(now)
        self._phase, self._phase_start = name, now
        return True

    def _finish_startup_locked(self, target: EngineState, reason: str | None, now: float) -> bool:
        if target not in _ALLOWED[self._state]:
            return False  # e.g. the start-up finished after a drain began, or a late failure after STOPPED
        if self._state is EngineState.STARTING:
            self._close_phase_locked(now, failed=target is EngineState.FAILED)
            self._ended = now
        if reason is not None:
            self._reason = reason
        if target is EngineState.READY:
            self._ready_at = now
        return self._move_locked(target, now)

    def _move_locked(self, target: EngineState, now: float) -> bool:
        if target is self._state:
            return False
        if target not in _ALLOWED[self._state]:
            raise InvalidTransition(f"cannot go from {self._state.value} to {target.value}")
        if self._state is EngineState.STARTING:
            # Drained mid start-up: the phase in progress never finished; keep what did.
            self._phase = None
            self._ended = now if self._ended is None else self._ended
        self._state = target
        return True

    def _snapshot_locked(self, now: float) -> StateSnapshot:
        end = self._ended if self._ended is not None else now
        return StateSnapshot(
            state=self._state,
            phase=self._phase,
            reason=self._reason,
            finished_phases=tuple(self._finished),
            phase_elapsed_s=(now - self._phase_start) if self._phase is not None else 0.0,
            startup_elapsed_s=end - self._started,
            ready_at=self._ready_at,
        )


def estimate_remaining(snap: StateSnapshot, expected: Mapping[str, float] | None, scale: float = 1.0) -> float | None:
    """Seconds until READY if this start goes like the recorded one(s) it was matched with; None without a profile.

    Phases still to come count in full, the running one counts its expected time less what it has used (never
    below zero: an overrunning phase says "any moment now", not a negative ETA). `scale` (wall / sum of the
    stages of the recorded start, at most 1) takes off what stages running at once saved, but never below the
    longest phase still to come: running beside others does not shorten a phase itself.
    """
    if snap.state is not EngineState.STARTING:
        return 0.0 if snap.state is EngineState.READY else None
    if not expected:
        return None
    done = set(snap.phase_seconds())
    remaining = longest = 0.0
    for name, seconds in expected.items():
        # Pre-main rows (process_start, imports) of the last start are over by the time anyone can ask, unless
        # the service's own engine import is the phase running now.
        if name in done or (name in PRE_MAIN and name != snap.phase):
            continue
        left = max(0.0, seconds - snap.phase_elapsed_s) if name == snap.phase else max(0.0, seconds)
        remaining += left
        longest = max(longest, left)
    return max(remaining * scale, longest)
