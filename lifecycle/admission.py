"""What admission control knows about the engine: how fast requests finish, and what prompt work costs.

A new request waits for two things before its first token: a free sequence slot, and the prompts admitted ahead of
it being computed. The first is estimated from the rate at which requests have been finishing (Little's law); the
second from the prompt tokens ahead of it, at the cost recent steps' prompt parts took. Without the second term a
burst of arrivals that finds free slots is admitted whole, and the last of the burst waits for all the others'
prefills: under overload that, not the slot wait, is what pushed the admitted p99 TTFT up
(reports/serve/overload.md).

A prompt part costs a fixed part (an eager pass over every layer, and attention over the cached prefix) plus a part
per new token. Both are fitted to the recent steps with the Theil-Sen estimator (the median of the slopes between
pairs of steps, then the median intercept), which shrugs off the slow steps right after READY and any stall. A
single per-token ratio does not fit: a 10-token chunk after a cached prefix costs as much as 100 fresh tokens, and
would read as 6 ms a token (measured on the 2-core CPU with SmolLM2, bf16).

`PrefillCost.observe` runs on the engine loop thread after each step; readers on the event loop see a fit that is
replaced whole (one attribute), which needs no lock in CPython.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

# The finish rate: requests ended within this many seconds (at most _RATE_SAMPLES of them).
_RATE_WINDOW_S = 10.0
_RATE_SAMPLES = 512
# The prompt-part cost is fitted to this many recent steps, and to none before this many: the first steps after READY
# run beside the KV pool's commit and build oneDNN's first primitives, and read many times slower.
_COST_SAMPLES = 31
_MIN_COST_SAMPLES = 8


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


@dataclass(frozen=True)
class PromptCostFit:
    """seconds(tokens) = fixed_s + token_s * tokens, for one step's prompt part."""

    fixed_s: float
    token_s: float

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.token_s * tokens if tokens > 0 else 0.0


class PrefillCost:
    """The cost of a step's prompt part, fitted to recent steps (module docstring). The engine times the prompt
    part on its own (a mixed step runs the prompts eagerly, apart from the compiled decode rows), so prompt tokens
    riding on a large decode batch are not charged for it."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=_COST_SAMPLES)
        self.fit: PromptCostFit | None = None

    def observe(self, prefill_s: float, prefill_tokens: int) -> bool:
        """Take one step's prompt part; True when the fit changed."""
        if prefill_tokens <= 0 or prefill_s <= 0.0:
            return False
        self._samples.append((prefill_tokens, prefill_s))
        if len(self._samples) < _MIN_COST_SAMPLES:
            return False
        self.fit = theil_sen(list(self._samples))
        return True

    def seconds(self, tokens: int) -> float | None:
        """Seconds to compute `tokens` prompt tokens in one step; None until fitted."""
        fit = self.fit
        return None if fit is None else fit.seconds(tokens)


def theil_sen(samples: list[tuple[int, float]]) -> PromptCostFit:
    """Robust line through (tokens, seconds): the median slope over pairs of different token counts, then the
    median intercept. With one token count only (every step the same prompt size) the slope cannot be told from
    the intercept, and the whole cost is charged per token: an overestimate for more tokens, never an under one.
    Negative slopes or intercepts (noise) are clipped to 0."""
    slopes = [(t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(samples) for n2, t2 in samples[i + 1 :] if n2 != n1]
    if not slopes:
        return PromptCostFit(0.0, statistics.median(t / n for n, t in samples))
    slope = max(statistics.median(slopes), 0.0)
    fixed = max(statistics.median(t - slope * n for n, t in samples), 0.0)
    return PromptCostFit(fixed, slope)


def expected_wait_s(
    *,
    ahead_seqs: int,
    free_slots: int,
    finish_rate: float | None,
    prompt_wait_s: float | None,
) -> float | None:
    """Seconds until a new request's own prompt starts computing; None when nothing is known yet.

    `ahead_seqs` counts the new request's own sequences too: they need slots. `prompt_wait_s` is the time the prompt
    tokens admitted ahead take (not the request's own prompt: computing that is its own time, whatever the load).
    """
    if ahead_seqs <= free_slots:
        slot_wait: float | None = 0.0
    else:
        slot_wait = None if finish_rate is None else (ahead_seqs - free_slots) / finish_rate
    prefill_wait = prompt_wait_s or 0.0
    if slot_wait is None:
        return None if prefill_wait == 0.0 else prefill_wait
    return slot_wait + prefill_wait
