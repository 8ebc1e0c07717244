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

The engine core reports its state and each step's prompt part with every step's outputs (engine/core_proc.py);
the core client hands them here on the event loop, where admission also runs, so nothing here needs a lock.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .generation import Ticket
from .state import EngineState, StateSnapshot

if TYPE_CHECKING:
    from glowplug.engine.core_frames import CoreLoad

    from .config import ServeConfig
    from .metrics import ServiceMetrics

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


class Rejected(Exception):
    """The request cannot be served now; `status` 503 (not ready, draining, failed) or 429 (queue full)."""

    def __init__(self, status: int, message: str, reason: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason  # the `reason` label of glowplug_request_rejected_total
        self.retry_after = retry_after


class Admission:
    """Who may come in, decided at the boundary from the engine core's reported state (the one owner of it).

    A request holds one slot per prompt from arrival until the core first schedules it (or it ends), so
    `max_queue` bounds the work that is accepted but not started, including requests waiting for READY. On top of
    that count, admission is by expected wait (`max_queue_wait`), checked twice: on arrival for a sequence slot
    (when the prompts ahead fit the slots the core reports free there is no slot wait; otherwise it waits for that
    many requests to finish, at the rate requests have been finishing lately), and once the prompt is tokenized for
    the prompt tokens admitted ahead of it plus the core's own prompt backlog, at the per-token cost the core's
    recent steps measured (`observe_step`). A request whose expected wait exceeds the limit gets 429 with that wait
    as Retry-After, so the requests that are admitted keep their time to first token under overload instead of
    queueing without bound. What is not known yet (a fresh server) counts as no wait.
    """

    def __init__(
        self,
        serve_cfg: ServeConfig,
        metrics: ServiceMetrics,
        *,
        state: Callable[[], StateSnapshot],
        eta_s: Callable[[StateSnapshot], float | None],
        load: Callable[[], CoreLoad | None],
    ) -> None:
        self._cfg = serve_cfg
        self._metrics = metrics
        self._state = state
        self._eta_s = eta_s
        self._load = load
        self.prefill_cost = PrefillCost()
        self._finish_rate = FinishRate()  # of engine requests
        self._queued = 0
        self._queued_prompt_tokens = 0  # of the admitted requests not yet scheduled whose prompts are tokenized
        self._wait_basis = ""  # what the last expected wait was made of, for the 429 message

    # ------------------------------------------------------------ what the core reports

    def observe_step(self, prefill_s: float, prefill_tokens: int) -> None:
        """One step's prompt part, as the core timed it."""
        if self.prefill_cost.observe(prefill_s, prefill_tokens) and self.prefill_cost.fit is not None:
            self._metrics.set_prompt_cost(self.prefill_cost.fit.fixed_s, self.prefill_cost.fit.token_s)

    def note_finished(self) -> None:
        """An engine request ended (finished, aborted or failed)."""
        self._finish_rate.note()

    def finish_rate(self, now: float | None = None) -> float | None:
        """Engine requests ended per second over the last few seconds; None before two have ended."""
        return self._finish_rate.per_second(now)

    # ------------------------------------------------------------ deciding

    def rejection_for_state(self, snap: StateSnapshot) -> Rejected | None:
        if snap.state in (EngineState.DRAINING, EngineState.STOPPED):
            return Rejected(503, "the server is shutting down and accepts no new requests", "draining")
        if snap.state is EngineState.FAILED:
            return Rejected(503, f"the engine failed: {snap.reason}", "failed")
        return None

    def retry_after(self, snap: StateSnapshot) -> int:
        eta = self._eta_s(snap)
        return max(1, math.ceil(eta)) if eta is not None else 1

    def expected_wait_s(self, count: int, *, prompt_tokens: bool = False) -> float | None:
        """Seconds a new request of `count` more prompts would wait for its own prompt to start computing; None when
        unknown. `prompt_tokens`: also wait for the tokenized prompts admitted ahead (and the core's backlog)."""
        load = self._load()
        if load is None:
            return None
        free = max(0, load.max_num_seqs - load.running_seqs)
        ahead_tokens = self._queued_prompt_tokens + load.prefill_backlog if prompt_tokens else 0
        self._wait_basis = f"{self._queued + count} requests for {free} free slots, {ahead_tokens} prompt tokens ahead"
        return expected_wait_s(
            ahead_seqs=self._queued + count,
            free_slots=free,
            finish_rate=self.finish_rate(),
            prompt_wait_s=self.prefill_cost.seconds(ahead_tokens),
        )

    def _over_wait_limit(self, wait: float | None) -> Rejected | None:
        limit = self._cfg.max_queue_wait
        if wait is None or limit is None or wait <= limit:
            return None
        return Rejected(
            429,
            f"the server is busy: a new request would wait about {wait:.1f} s for the engine "
            f"({self._wait_basis}; max-queue-wait {limit:g} s); retry later",
            "queue_wait",
            retry_after=max(1, math.ceil(wait)),
        )

    def reject(self, rejection: Rejected) -> Rejected:
        self._metrics.rejected.labels(reason=rejection.reason).inc()
        return rejection

    def admit(self, count: int) -> Ticket:
        """Take `count` admission slots (one per prompt) or raise Rejected (503 / 429)."""
        snap = self._state()
        rejection = self.rejection_for_state(snap)
        limit = self._cfg.max_queue_wait
        wait = self.expected_wait_s(count) if rejection is None and limit is not None else None
        if rejection is None and self._queued + count > self._cfg.max_queue:
            rejection = Rejected(
                429,
                f"the server is busy: {self._queued} requests are queued (max-queue {self._cfg.max_queue}); "
                "retry later",
                "queue_full",
                retry_after=max(1, math.ceil(wait)) if wait is not None else 1,
            )
        elif rejection is None:
            rejection = self._over_wait_limit(wait)
        if rejection is not None:
            raise self.reject(rejection)
        self._queued += count
        self._metrics.waiting.set(self._queued)
        return Ticket(count, self._release)

    def admit_prompts(self, ticket: Ticket, lengths: list[int]) -> None:
        """The second admission check, once the prompts are tokenized: the prompt tokens admitted ahead must be
        computed within the wait limit. Raises Rejected (429) and gives the ticket back, or holds the tokens on it
        until the core schedules them."""
        if self._cfg.max_queue_wait is not None:
            # The ticket's own slots are already in `_queued`.
            rejection = self._over_wait_limit(self.expected_wait_s(0, prompt_tokens=True))
            if rejection is not None:
                ticket.release_all()
                raise self.reject(rejection)
        ticket.hold_tokens(lengths)
        self._queued_prompt_tokens += sum(lengths[: ticket.held])
        self._metrics.waiting_prompt_tokens.set(self._queued_prompt_tokens)

    def _release(self, count: int, prompt_tokens: int) -> None:
        self._queued -= count
        self._queued_prompt_tokens -= prompt_tokens
        self._metrics.waiting.set(self._queued)
        self._metrics.waiting_prompt_tokens.set(self._queued_prompt_tokens)
