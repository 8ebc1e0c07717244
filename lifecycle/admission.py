"""What admission control knows about the engine: when its sequence slots free up, and what prompt work costs.

A new request waits for three things before its first token: a free sequence slot, the prompts admitted ahead of
it being computed, and its own prompt. All are read from what the engine core reports after every step
(engine/core_proc.py), not from a rate the server infers:

- The slot wait. The core names, for every running sequence, the tokens it has generated and its max_tokens. How
  many steps each has left is taken from the sequences that finished lately (OutputLengths): where one that has
  run that far stops by itself, at a high quantile, or its max_tokens when that comes first or the finished ones do
  not say. The k-th slot frees after the k-th shortest of those, at the measured time of a decode step; requests
  queued ahead take the slots in turn. A rate of finished requests cannot stand in for this: it is unknown after a
  quiet spell, and the slots free in bursts, not at a rate.
- The prompt work: the prompt tokens admitted ahead of it, the core's own prompt backlog and its own prompt, at the
  cost the recent steps' prompt parts took. A prompt part costs a fixed part (an eager pass over every layer, and
  attention over the cached prefix) plus a part per new token, both fitted with the Theil-Sen estimator (the median
  of the slopes between pairs of steps, then the median intercept), which shrugs off the slow steps right after
  READY and any stall. A single per-token ratio does not fit: a 10-token chunk after a cached prefix costs as much
  as 100 fresh tokens (until enough steps were seen for the line, it stands in: an overestimate). A decode step's
  time is fitted the same way against its number of rows.

The core client hands the reports here on the event loop, where admission also runs, so nothing here needs a lock.
"""

from __future__ import annotations

import bisect
import heapq
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .generation import Ticket
from .state import EngineState, StateSnapshot

if TYPE_CHECKING:
    from glowplug.engine.core_frames import CoreLoad

    from .config import ServeConfig
    from .core_client import StepReport
    from .metrics import ServiceMetrics

# The prompt-part and decode-step costs are fitted to this many recent steps. The first step after READY runs beside
# the KV pool's commit and builds oneDNN's first primitives, and reads many times slower: from _MIN_COST_SAMPLES
# steps on, the median cost per unit (which one slow step cannot move, and which overestimates a short chunk after a
# cached prefix rather than under one), and from _FIT_SAMPLES on the Theil-Sen line. Waiting for the line alone
# would leave the first requests of a burst priced at nothing: a server warmed up with one batch has seen one or two
# prompt steps.
_COST_SAMPLES = 31
_MIN_COST_SAMPLES = 3
_FIT_SAMPLES = 8
# Output lengths of this many recently finished sequences say how long the running ones still run.
_LENGTH_SAMPLES = 256
# Which quantile of those lengths a running sequence is assumed to reach: the wait is meant as a bound on what an
# admitted request sees, so a high one; not the maximum, so one long outlier does not set it for the next 256.
_LENGTH_QUANTILE = 0.9


@dataclass(frozen=True)
class CostFit:
    """seconds(n) = fixed_s + per_s * n: one step's prompt part against its new tokens, or its decode part against
    its rows."""

    fixed_s: float
    per_s: float

    def seconds(self, n: int) -> float:
        return self.fixed_s + self.per_s * n if n > 0 else 0.0


class StepCost:
    """A step part's cost against its size, fitted to the recent steps (module docstring), refitted when asked after
    a change (the fit is pairwise over the samples: not once per step on the event loop)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=_COST_SAMPLES)
        self._fit: CostFit | None = None
        self._stale = False

    def observe(self, seconds: float, size: int) -> None:
        if size > 0 and seconds > 0.0:
            self._samples.append((size, seconds))
            self._stale = True

    @property
    def fit(self) -> CostFit | None:
        """None until _MIN_COST_SAMPLES steps were seen."""
        if self._stale:
            self._stale = False
            samples = list(self._samples)
            if len(samples) >= _FIT_SAMPLES:
                self._fit = theil_sen(samples)
            elif len(samples) >= _MIN_COST_SAMPLES:
                self._fit = CostFit(0.0, statistics.median(t / n for n, t in samples))
        return self._fit

    def seconds(self, size: int) -> float | None:
        """Seconds for a step part of `size` (tokens or rows); None until fitted."""
        fit = self.fit
        return None if fit is None else fit.seconds(size)


def theil_sen(samples: list[tuple[int, float]]) -> CostFit:
    """Robust line through (size, seconds): the median slope over pairs of different sizes, then the median
    intercept. With one size only (every step the same prompt size, or a full batch) the slope cannot be told from
    the intercept, and the whole cost is charged per unit: an overestimate for larger sizes, never an under one.
    Negative slopes or intercepts (noise) are clipped to 0."""
    slopes = [(t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(samples) for n2, t2 in samples[i + 1 :] if n2 != n1]
    if not slopes:
        return CostFit(0.0, statistics.median(t / n for n, t in samples))
    slope = max(statistics.median(slopes), 0.0)
    fixed = max(statistics.median(t - slope * n for n, t in samples), 0.0)
    return CostFit(fixed, slope)


class OutputLengths:
    """How long sequences run, from the recently finished ones: the Kaplan-Meier estimate of a sequence's own length
    (where it would stop by itself). One that stopped (a stop token, EOS, a stop string) shows its length; one cut
    at max_tokens only shows that it would have run at least that long (a censored length), so a workload whose
    requests all run to max_tokens is expected to run to max_tokens, whatever lengths they were given. Aborted ones
    say nothing and are left out."""

    def __init__(self) -> None:
        self._seen: deque[tuple[int, bool]] = deque(maxlen=_LENGTH_SAMPLES)  # (length, stopped by itself)
        self._times: list[int] = []  # lengths at which some sequence stopped by itself, ascending
        self._neg_survival: list[float] = []  # -P(length > t) at each of those (ascending: bisect finds a level)
        self._longest = 0
        self._stale = False

    def note(self, length: int, stopped: bool) -> None:
        if length > 0:
            self._seen.append((length, stopped))
            self._stale = True

    def _curve(self) -> None:
        if not self._stale:
            return
        self._stale = False
        seen = sorted(self._seen)
        self._times, self._neg_survival = [], []
        self._longest = seen[-1][0] if seen else 0
        survival, at_risk, i = 1.0, len(seen), 0
        while i < len(seen):
            length, stops, j = seen[i][0], 0, i
            while j < len(seen) and seen[j][0] == length:
                stops += seen[j][1]
                j += 1
            if stops:
                survival *= 1.0 - stops / at_risk
                self._times.append(length)
                self._neg_survival.append(-survival)
            at_risk -= j - i
            i = j

    def _end(self, generated: int) -> int | None:
        """The length by which a sequence that has run `generated` tokens without stopping will have stopped by
        itself, with probability _LENGTH_QUANTILE; None when the finished ones do not say (too few of them stopped
        past `generated`)."""
        self._curve()
        i = bisect.bisect_right(self._times, generated)
        alive = -self._neg_survival[i - 1] if i > 0 else 1.0
        # (A hair over the level: the product above rounds, and a level met exactly must count as met.)
        k = bisect.bisect_left(self._neg_survival, -(1.0 - _LENGTH_QUANTILE) * alive * (1 + 1e-9), lo=i)
        return self._times[k] if k < len(self._times) else None

    def steps_left(self, generated: int, max_tokens: int) -> int:
        """Decode steps a running sequence with `generated` tokens is expected to run at most (see _LENGTH_QUANTILE):
        to its own expected stop, or to max_tokens when that comes first or nothing says otherwise."""
        end = self._end(generated)
        return max(1, min(max_tokens if end is None else end, max_tokens) - generated)

    def typical_run(self) -> int | None:
        """Steps a sequence that has not started is expected to run (its max_tokens unknown here): its expected
        stop, or the longest run seen when most run past every stop; None before any finished."""
        if not self._seen:
            return None
        end = self._end(0)
        return self._longest if end is None else end


def slot_wait_s(*, ahead_seqs: int, free_slots: int, running_left_s: list[float], run_s: float) -> float:
    """Seconds until the last of `ahead_seqs` waiting sequences (the new request's own are the last) holds a slot.

    `running_left_s`: how long each running sequence still runs; a sequence that takes a slot holds it `run_s`.
    The slots free in order and go to the waiting sequences first come, first served.
    """
    if ahead_seqs <= free_slots:
        return 0.0
    frees = [0.0] * free_slots + list(running_left_s)
    heapq.heapify(frees)
    if not frees:
        raise ValueError("no sequence slots: max-num-seqs must be at least 1")
    at = 0.0
    for _ in range(ahead_seqs):
        at = heapq.heappop(frees)
        heapq.heappush(frees, at + run_s)
    return at


def expected_wait_s(*, slot_wait_s: float | None, prompt_wait_s: float | None) -> float | None:
    """Seconds until a new request's first token: the slot wait, then the prompt work (its own included); None when
    nothing is known yet. An unknown term counts as none: the other is still a lower bound worth checking."""
    if slot_wait_s is None and prompt_wait_s is None:
        return None
    return (slot_wait_s or 0.0) + (prompt_wait_s or 0.0)


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
    that count, admission is by the expected wait for the first token (`max_queue_wait`), checked twice, on arrival
    and once the prompt is tokenized: the wait for a sequence slot (from the running sequences the core reports,
    the lengths sequences have been running to and the measured decode step) plus the prompt tokens admitted ahead
    of it, the core's own prompt backlog and, once known, its own prompt (at the measured prompt cost). A request
    whose expected wait exceeds the limit gets 429 with that wait as Retry-After, so the requests that are admitted
    keep their time to first token under overload instead of queueing without bound. A request that finds a free
    slot and no prompt work ahead is always admitted: nothing it could wait for would make it faster, and refusing
    it would leave the engine idle. What is not known yet (a fresh server, before its first steps) counts as no
    wait.
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
        self.prefill_cost = StepCost()  # a step's prompt part against its new prompt tokens
        self.decode_cost = StepCost()  # a step's decode part against its decode rows
        self.lengths = OutputLengths()
        self._queued = 0
        self._queued_prompt_tokens = 0  # of the admitted requests not yet scheduled whose prompts are tokenized
        self._wait_basis = ""  # what the last expected wait was made of, for the 429 message
        self._nothing_ahead = True  # the last expected wait found a free slot and no prompt work ahead

    # ------------------------------------------------------------ what the core reports

    def observe_step(self, report: StepReport) -> None:
        """One step as the core timed it: its prompt part and, apart from it, its decode part."""
        if report.prefill_tokens > 0 and report.prefill_s > 0.0:
            self.prefill_cost.observe(report.prefill_s, report.prefill_tokens)
            fit = self.prefill_cost.fit
            if fit is not None:
                self._metrics.set_prompt_cost(fit.fixed_s, fit.per_s)
        if report.decode_rows > 0:
            self.decode_cost.observe(report.step_s - report.prefill_s, report.decode_rows)

    def note_finished(self, completions: list[tuple[int, bool]]) -> None:
        """A request ended by stop or length: each completion's (token count, whether it stopped by itself rather
        than at max_tokens). Aborted and failed requests are not noted."""
        for length, stopped in completions:
            self.lengths.note(length, stopped)

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

    def expected_wait_s(self, count: int, own_tokens: int = 0) -> float | None:
        """Seconds a new request of `count` more prompts (`own_tokens` prompt tokens, once tokenized) would wait for
        its first token; None when unknown. The prompts already admitted and not yet scheduled are ahead of it, and
        so are the core's preempted sequences waiting to resume."""
        load = self._load()
        if load is None:
            return None
        ahead = load.resumed_seqs + self._queued + count
        free = max(0, load.max_num_seqs - load.running_seqs)
        slot_wait: float | None = 0.0
        if ahead > free:
            step = self.decode_cost.seconds(max(1, load.running_seqs))
            if step is None:
                slot_wait = None
            else:
                left = [self.lengths.steps_left(g, m) for g, m in zip(load.generated, load.max_tokens, strict=True)]
                run = self.lengths.typical_run() or max(left, default=1)
                slot_wait = slot_wait_s(
                    ahead_seqs=ahead, free_slots=free, running_left_s=[n * step for n in left], run_s=run * step
                )
        ahead_tokens = self._queued_prompt_tokens + load.prefill_backlog
        prompt_wait = self.prefill_cost.seconds(ahead_tokens + own_tokens)
        self._nothing_ahead = ahead <= free and ahead_tokens == 0
        self._wait_basis = (
            f"{ahead} sequences for {free} free slots"
            + ("" if slot_wait is None else f" ({slot_wait:.2f} s)")
            + f", {ahead_tokens} prompt tokens ahead and {own_tokens} of its own"
            + ("" if prompt_wait is None else f" ({prompt_wait:.2f} s)")
        )
        return expected_wait_s(slot_wait_s=slot_wait, prompt_wait_s=prompt_wait)

    def _over_wait_limit(self, wait: float | None) -> Rejected | None:
        limit = self._cfg.max_queue_wait
        if wait is None or limit is None or wait <= limit or self._nothing_ahead:
            return None
        return Rejected(
            429,
            f"the server is busy: a new request would wait about {wait:.1f} s for its first token "
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
        """The second admission check, once the prompts are tokenized: the prompt tokens admitted ahead and its own
        must be computed within the wait limit. Raises Rejected (429) and gives the ticket back, or holds the tokens
        on it until the core schedules them."""
        if self._cfg.max_queue_wait is not None:
            # The ticket's own slots are already in `_queued`, its tokens not yet in `_queued_prompt_tokens`.
            rejection = self._over_wait_limit(self.expected_wait_s(0, sum(lengths[: ticket.held])))
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
