"""What admission control knows about the engine: how fast requests finish, and what a prompt token costs.

A new request waits for two things before its first token: a free sequence slot, and the prompts admitted ahead of
it being computed. The first is estimated from the rate at which requests have been finishing (Little's law); the
second from the prompt tokens ahead of it times the seconds per prompt token that recent steps took. Without the
second term a burst of arrivals that finds free slots is admitted whole, and the last of the burst waits for all
the others' prefills: under overload that, not the slot wait, is what pushed the admitted p99 TTFT up
(reports/serve/overload.md).

`PrefillCost.observe` runs on the engine loop thread after each step; the readers run on the event loop. Each
reads or replaces a single float, which needs no lock in CPython.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

# The finish rate: requests ended within this many seconds (at most _RATE_SAMPLES of them).
_RATE_WINDOW_S = 10.0
_RATE_SAMPLES = 512
# The prompt-token cost: median of this many recent steps.
_COST_SAMPLES = 31
# Steps with fewer prompt tokens than this say little about the per-token cost (the step's fixed part dominates).
_MIN_PREFILL_TOKENS = 16


class FinishRate:
    """Engine requests ended per second over the last few seconds."""

    def __init__(self) -> None:
        self._ends: deque[float] = deque(maxlen=_RATE_SAMPLES)

    def note(self, when: float | None = None) -> None:
        self._ends.append(time.monotonic() if when is None else when)

    def per_second(self, now: float | None = None) -> float | None:
        """None before two requests have ended within the window."""
        now = time.monotonic() if now is None else now
        recent = [t for t in self._ends if t >= now - _RATE_WINDOW_S]
        if len(recent) < 2:
            return None
        # Up to now, not to the last end: a stall since then must lower the rate.
        return len(recent) / max(now - recent[0], 1e-3)


class PrefillCost:
    """Seconds per prompt token: the median over recent steps of (time of the step's prompt part / its prompt
    tokens). The engine times the prompt part on its own (a mixed step runs the prompts eagerly, apart from the
    compiled decode rows), so a few prompt tokens riding on a large decode batch do not read as expensive ones; the
    median keeps one slow step (a page-fault storm, a descheduled thread) from moving the estimate."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=_COST_SAMPLES)
        self.token_s: float | None = None

    def observe(self, prefill_s: float, prefill_tokens: int) -> None:
        if prefill_tokens < _MIN_PREFILL_TOKENS or prefill_s <= 0.0:
            return
        self._samples.append(prefill_s / prefill_tokens)
        # Replaced whole: readers on other threads see the old value or the new one.
        self.token_s = statistics.median(self._samples)


def expected_wait_s(
    *,
    ahead_seqs: int,
    free_slots: int,
    finish_rate: float | None,
    ahead_prompt_tokens: int,
    prompt_token_s: float | None,
) -> float | None:
    """Seconds until a new request's own prompt starts computing; None when nothing is known yet.

    `ahead_seqs` counts the new request's own sequences too: they need slots. `ahead_prompt_tokens` does not count
    its own prompt: computing that is the request's own time, whatever the load.
    """
    if ahead_seqs <= free_slots:
        slot_wait: float | None = 0.0
    else:
        slot_wait = None if finish_rate is None else (ahead_seqs - free_slots) / finish_rate
    prefill_wait = 0.0 if prompt_token_s is None or ahead_prompt_tokens <= 0 else ahead_prompt_tokens * prompt_token_s
    if slot_wait is None:
        return None if prefill_wait == 0.0 else prefill_wait
    return slot_wait + prefill_wait
