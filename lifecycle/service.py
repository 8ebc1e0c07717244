"""The service behind the HTTP routes: life cycle, admission, the start-up thread, the engine loop, draining.

Threads: the start-up runs on `glowplug-startup`, then the engine is stepped on `glowplug-engine-loop`; everything
in this class that is not marked otherwise runs on the asyncio event loop thread. State changes made by the other
threads reach asyncio through `call_soon_threadsafe`, which wakes requests waiting for READY.

Admission: a request holds one slot per prompt from arrival until the engine first schedules it (or it ends), so
`max_queue` bounds the work that is accepted but not started, including requests waiting for READY. On top of that
count, admission is by expected wait (`max_queue_wait`, lifecycle/admission.py), checked twice: on arrival for a
sequence slot (when the prompts ahead fit the free slots there is no slot wait; otherwise it waits for that many
requests to finish, at the rate requests have been finishing lately), and once the prompt is tokenized for the
prompt tokens admitted ahead of it, at the per-token cost recent steps showed. A request whose expected wait exceeds
the limit gets 429 with that wait as Retry-After, so the requests that are admitted keep their time to first token
under overload instead of queueing without bound. What is not known yet (a fresh server) counts as no wait.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from glowplug.engine.config import EngineConfig
from glowplug.engine.generation_config import SamplingDefaults, sampling_defaults
from glowplug.engine.sampling_params import SamplingParams
from glowplug.profiling.names import IMPORTS, PRE_MAIN, STAGE_ROWS
from glowplug.profiling.process import ProcessMarks
from glowplug.profiling.tracing import Tracing, setup_tracing

from .admission import FinishRate, expected_wait_s
from .config import ServeConfig
from .engine_loop import EngineLoop, Submission
from .generation import Generation, Ticket
from .metrics import ServiceMetrics
from .startup_runner import EngineFactory, StartupRunner, phase_table_seconds
from .state import EngineState, Lifecycle, StateSnapshot, estimate_remaining
from .timeline import StartupTimeline

if TYPE_CHECKING:
    from glowplug.engine.llm_engine import RequestOutput

log = structlog.get_logger("glowplug.lifecycle.service")

def _round6(value: float) -> float:
    return round(value, 6)


# After a drain gives up and aborts what is left, how long the responses get to send their last chunk.
_ABORT_FLUSH_S = 5.0


class Rejected(Exception):
    """The request cannot be served now; `status` 503 (not ready, draining, failed) or 429 (queue full)."""

    def __init__(self, status: int, message: str, reason: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason  # the `reason` label of glowplug_request_rejected_total
        self.retry_after = retry_after


@dataclass(frozen=True)
class DrainReport:
    """How a drain went: of the requests in flight when it began, how many finished and how many were aborted."""

    timeout_s: float
    in_flight: int
    finished: int
    aborted: int

    @property
    def clean(self) -> bool:
        return self.aborted == 0


@dataclass(frozen=True)
class EngineInfo:
    """What request handling may read from the engine (all fixed once built; the engine itself is off limits)."""

    tokenizer: Any
    max_model_len: int
    # The engine's own request check (vocabulary and length; reads only fixed state), so HTTP errors word it
    # exactly as the engine does.
    validate_request: Callable[[list[int], SamplingParams], None]


class Service:
    def __init__(
        self,
        config: EngineConfig,
        serve_cfg: ServeConfig,
        *,
        tracing: Tracing | None = None,
        marks: ProcessMarks | None = None,
        engine_factory: EngineFactory | None = None,
        metrics: ServiceMetrics | None = None,
    ) -> None:
        self.config = config
        self.serve_cfg = serve_cfg
        self.model_name = serve_cfg.model_name(config.model)
        # What a request's unset sampling fields become: the model's generation config, else glowplug's default
        # (greedy), the same as `glowplug generate` uses; logged at start and shown in /v1/models.
        self.sampling_defaults: SamplingDefaults = sampling_defaults(config.model)
        self.lifecycle = Lifecycle()
        self.metrics = metrics or ServiceMetrics()
        self.engine_info: EngineInfo | None = None
        self.startup_result: Any = None
        # Made here rather than by the engine's start-up, so that the live timeline can watch its spans.
        self.tracing = tracing or setup_tracing("glowplug", in_memory=True)
        self._runner = StartupRunner(
            config,
            self.lifecycle,
            on_ready=self._startup_done,
            on_failed=self._startup_failed,
            factory=engine_factory,
            tracing=self.tracing,
            marks=marks,
            on_plan=self._plan_made,
        )
        self._first_predicted_s: float | None = None
        # The start-up's phases as its spans start and end (the page, /startup/events and /startup read it).
        self.timeline = StartupTimeline(
            accept=self._runner.on_startup_thread, origin_ns=marks.process_start_ns if marks is not None else None
        )
        self.tracing.provider.add_span_processor(self.timeline)
        self._engine_loop: EngineLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._queued = 0
        self._queued_prompt_tokens = 0  # of the admitted requests not yet scheduled whose prompts are tokenized
        self._wait_basis = ""  # what the last expected wait was made of, for the 429 message
        self._active: set[Generation] = set()
        self._idle: asyncio.Event | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._finish_rate = FinishRate()  # of engine requests

    # ------------------------------------------------------------ start and state

    def start(self) -> None:
        """Begin the start-up; call on the event loop that serves the requests."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._unsubscribe = self.lifecycle.subscribe(self._state_changed)
        log.info("sampling defaults", model=self.model_name, source=self.sampling_defaults.source,
                 **self.sampling_defaults.values)  # fmt: skip
        self._runner.start()

    def snapshot(self) -> StateSnapshot:
        return self.lifecycle.snapshot()

    def eta_s(self, snap: StateSnapshot | None = None) -> float | None:
        """Seconds until READY: 0 once READY, None when unknown or not starting. From the plan's estimate
        (engine/start_estimate.py `remaining_s`) over the stages finished and running now, by their spans, so
        stages that run at once are all counted and one that overruns its estimate keeps the ETA growing; before
        the first stage, the early plan's time to the first stage less what has passed, plus the stages."""
        snap = snap or self.snapshot()
        if snap.state is EngineState.READY:
            return 0.0
        if snap.state is not EngineState.STARTING:
            return None
        estimate = self._runner.estimate
        if estimate is None:
            return estimate_remaining(snap, self._runner.expected_phase_seconds, self._runner.eta_scale)
        from glowplug.engine.start_estimate import OVERRUN_SHARE

        timeline = self.timeline.snapshot()
        now = self.timeline.now_s()
        elapsed = now if now is not None else snap.startup_elapsed_s
        if not timeline["phases"] and not timeline["running"]:
            importing = snap.phase == IMPORTS and estimate.imports_s is not None
            e = snap.phase_elapsed_s
            rest = max(estimate.imports_s - e, OVERRUN_SHARE * e) if importing else 0.0
            return rest + estimate.total_s
        finished = {p["stage"] for p in timeline["phases"]}
        running = {p["stage"]: max(0.0, elapsed - p["start_s"]) for p in timeline["running"]}
        return float(estimate.remaining_s(finished, running))

    def startup_now_s(self, snap: StateSnapshot | None = None) -> float:
        """Seconds into the start: from process creation when the process marks were taken (the phase table's
        origin), else from the service's own start."""
        now = self.timeline.now_s()
        return now if now is not None else (snap or self.snapshot()).startup_elapsed_s

    def startup_total_s(self, snap: StateSnapshot | None = None) -> float:
        """The one time to READY every place shows (the log line, /startup, the page): the phase table's
        actual_total_time once there is a table, else the start-up span's end, else the time so far."""
        table = getattr(self.startup_result, "phase_table", None)
        if table is not None:
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
        return self._first_predicted_s

    def refresh_prediction(self) -> None:
        """Set the predicted-READY gauge (the latest prediction while starting, the actual time once READY)."""
        snap = self.snapshot()
        if snap.state is EngineState.STARTING:
            self.metrics.set_startup_predicted(first=self._first_predicted_s, latest=self.predicted_ready_s(snap))
        elif snap.state is EngineState.READY:
            self.metrics.set_startup_predicted(first=self._first_predicted_s, latest=self.startup_total_s(snap))

    def _plan_made(self) -> None:
        # On the start-up thread, after each plan: the first prediction is kept for the gauge and /startup.
        predicted = self.predicted_ready_s()
        if predicted is not None and self._first_predicted_s is None:
            self._first_predicted_s = predicted
        self.refresh_prediction()

    def running_phases(self, snap: StateSnapshot | None = None) -> list[str]:
        """Every stage running now, in the order they began (stages run at once); before the first stage span
        (the engine import) the life cycle's phase. Empty once no longer starting."""
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
        """stage -> {seconds, kind, basis, inputs}: the current plan per phase (engine/startup.py
        phase_predictions), None without a plan."""
        estimate = self._runner.estimate
        if estimate is None:
            return None
        return {s: {"seconds": round(v, 6), **(src.to_json() if (src := estimate.sources.get(s)) is not None
                                                 else {"kind": "recorded"})}
                for s, v in estimate.seconds.items()}  # fmt: skip

    @property
    def expected_phase_seconds(self) -> dict[str, float] | None:
        return self._runner.expected_phase_seconds

    @property
    def eta_basis(self) -> str | None:
        """What the ETA comes from, in words (the page, /startup and the events show it beside the ETA)."""
        return self._runner.eta_basis

    def _state_changed(self, snap: StateSnapshot) -> None:
        # Any thread. Metrics are thread-safe; the asyncio wake-up is not, so it hops over.
        self.metrics.set_state(snap.state)
        if snap.state is not EngineState.STARTING:
            self.metrics.set_phase_durations(self.phase_row_seconds(snap))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake_waiters)
            except RuntimeError:
                pass  # the loop closed between the check and the call

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
        `state` (starting, running, ready, failed). Rank 0 is this process: its stages are the running phases.
        None for one rank, and before the engine (torch included) is imported: asking must never import it, since
        the HTTP thread answers while the engine thread imports."""
        import sys

        # The engine thread may be importing it right now: a partly imported module has no TPGroup yet.
        group_class = getattr(sys.modules.get("glowplug.engine.distributed"), "TPGroup", None)
        ranks = group_class.rank_progress() if group_class is not None else None
        if not ranks:
            return None
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

    def _wake_waiters(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        if old is not None:
            old.set()

    def _startup_done(self, result: Any) -> None:
        # On the start-up thread.
        engine = result.engine
        self.engine_info = EngineInfo(engine.tokenizer, engine.max_model_len, engine.validate_request)
        self.startup_result = result
        group = getattr(result, "parallel", None)
        if group is not None:
            # A tensor-parallel worker that dies fails the server at once, not at the next request's step.
            group.add_failure_callback(lambda message: self.lifecycle.mark_failed(message))
        assert self._loop is not None
        loop = EngineLoop(
            engine, metrics=self.metrics, on_crash=self._engine_crashed, post=self._loop.call_soon_threadsafe
        )
        loop.start()
        self._engine_loop = loop
        if not self.lifecycle.mark_ready():
            loop.stop("the server stopped during start-up")
            return
        # The phase table (from spans) is the authoritative record once there is one.
        self.metrics.set_phase_durations(phase_table_seconds(result))
        # One total: the phase table's time to READY (process creation -> READY), the same number as the table,
        # /startup and the page.
        log.info("engine ready", startup_s=round(self.startup_total_s(), 3), model=self.model_name)
        self.refresh_prediction()
        # After READY, not in the start-up: commit the KV pool on a thread (the kernel call releases the GIL), so
        # the server's footprint stops growing within seconds of READY instead of creeping up as the block
        # manager first walks the pool, and requests stop paying page faults.
        threading.Thread(target=self._commit_kv_cache, args=(engine,), name="kv-commit", daemon=True).start()

    def _commit_kv_cache(self, engine: Any) -> None:
        t0 = time.perf_counter()
        committed = engine.commit_kv_cache()
        log.info("kv cache committed" if committed else "kv cache commits on first use (the host cannot prefault)",
                 seconds=round(time.perf_counter() - t0, 3))  # fmt: skip

    def _startup_failed(self, reason: str, exc: BaseException) -> None:
        self.lifecycle.mark_failed(reason)

    def _engine_crashed(self, exc: BaseException) -> None:
        self.lifecycle.mark_failed(f"engine loop: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------ admission

    def _rejection_for_state(self, snap: StateSnapshot) -> Rejected | None:
        if snap.state in (EngineState.DRAINING, EngineState.STOPPED):
            return Rejected(503, "the server is shutting down and accepts no new requests", "draining")
        if snap.state is EngineState.FAILED:
            return Rejected(503, f"the engine failed to start: {snap.reason}", "failed")
        return None

    def _retry_after(self, snap: StateSnapshot) -> int:
        eta = self.eta_s(snap)
        return max(1, math.ceil(eta)) if eta is not None else 1

    def finish_rate(self, now: float | None = None) -> float | None:
        """Engine requests ended per second over the last few seconds; None before two have ended."""
        return self._finish_rate.per_second(now)

    def expected_wait_s(self, count: int, *, prompt_tokens: bool = False) -> float | None:
        """Seconds a new request of `count` more prompts would wait for its own prompt to start computing; None when
        unknown. `prompt_tokens`: also wait for the tokenized prompts admitted ahead (and the engine's backlog)."""
        engine_loop = self._engine_loop
        if engine_loop is None:
            return None
        load = engine_loop.load
        ahead_tokens = self._queued_prompt_tokens + load.prefill_backlog if prompt_tokens else 0
        self._wait_basis = (
            f"{self._queued + count} requests for {max(0, load.max_num_seqs - load.running_seqs)} free slots, "
            f"{ahead_tokens} prompt tokens ahead"
        )
        return expected_wait_s(
            ahead_seqs=self._queued + count,
            free_slots=max(0, load.max_num_seqs - load.running_seqs),
            finish_rate=self.finish_rate(),
            prompt_wait_s=engine_loop.prefill_cost.seconds(ahead_tokens),
        )

    def _over_wait_limit(self, wait: float | None) -> Rejected | None:
        limit = self.serve_cfg.max_queue_wait
        if wait is None or limit is None or wait <= limit:
            return None
        return Rejected(
            429,
            f"the server is busy: a new request would wait about {wait:.1f} s for the engine "
            f"({self._wait_basis}; max-queue-wait {limit:g} s); retry later",
            "queue_wait",
            retry_after=max(1, math.ceil(wait)),
        )

    def _reject(self, rejection: Rejected) -> Rejected:
        self.metrics.rejected.labels(reason=rejection.reason).inc()
        return rejection

    def admit(self, count: int) -> Ticket:
        """Take `count` admission slots (one per prompt) or raise Rejected (503 / 429)."""
        snap = self.snapshot()
        rejection = self._rejection_for_state(snap)
        limit = self.serve_cfg.max_queue_wait
        wait = self.expected_wait_s(count) if rejection is None and limit is not None else None
        if rejection is None and self._queued + count > self.serve_cfg.max_queue:
            rejection = Rejected(
                429,
                f"the server is busy: {self._queued} requests are queued (max-queue {self.serve_cfg.max_queue}); "
                "retry later",
                "queue_full",
                retry_after=max(1, math.ceil(wait)) if wait is not None else 1,
            )
        elif rejection is None:
            rejection = self._over_wait_limit(wait)
        if rejection is not None:
            raise self._reject(rejection)
        self._queued += count
        self.metrics.waiting.set(self._queued)
        return Ticket(count, self._release)

    def admit_prompts(self, ticket: Ticket, lengths: list[int]) -> None:
        """The second admission check, once the prompts are tokenized: the prompt tokens admitted ahead must be
        computed within the wait limit. Raises Rejected (429) and gives the ticket back, or holds the tokens on it
        until the engine schedules them."""
        if self.serve_cfg.max_queue_wait is not None:
            # The ticket's own slots are already in `_queued`.
            rejection = self._over_wait_limit(self.expected_wait_s(0, prompt_tokens=True))
            if rejection is not None:
                ticket.release_all()
                raise self._reject(rejection)
        ticket.hold_tokens(lengths)
        self._queued_prompt_tokens += sum(lengths[: ticket.held])
        self.metrics.waiting_prompt_tokens.set(self._queued_prompt_tokens)

    def _release(self, count: int, prompt_tokens: int) -> None:
        self._queued -= count
        self._queued_prompt_tokens -= prompt_tokens
        self.metrics.waiting.set(self._queued)
        self.metrics.waiting_prompt_tokens.set(self._queued_prompt_tokens)

    async def wait_ready(self, timeout: float) -> EngineInfo:
        """Wait (at most `timeout` s) until READY; Rejected(503) on timeout, failure or drain."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.snapshot()
            if snap.state is EngineState.READY and self.engine_info is not None:
                return self.engine_info
            rejection = self._rejection_for_state(snap)
            remaining = deadline - time.monotonic()
            if rejection is None and remaining <= 0:
                phase = self.phase_text(snap) or snap.state.value
                rejection = Rejected(
                    503,
                    f"the engine is starting (phase: {phase}); not ready after waiting {timeout:g} s",
                    "not_ready",
                    retry_after=self._retry_after(snap),
                )
            if rejection is not None:
                self.metrics.rejected.labels(reason=rejection.reason).inc()
                raise rejection
            assert self._changed is not None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------ generation

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        ticket: Ticket,
        *,
        received_at: float,
        on_close: Callable[[Generation], None] | None = None,
    ) -> Generation:
        """Submit one engine request per prompt; the caller must `close()` the Generation it gets back."""
        engine_loop = self._engine_loop
        if engine_loop is None or not engine_loop.alive:
            ticket.release_all()
            raise Rejected(503, "the engine is not running", "failed")
        base = uuid.uuid4().hex
        request_ids = [f"{base}-{i}" for i in range(len(prompts))]

        def observe(finish_reason: str, out: RequestOutput | None) -> None:
            self._observe(finish_reason, out, received_at)

        def closed(gen: Generation) -> None:
            self._active.discard(gen)
            if not self._active and self._idle is not None:
                self._idle.set()
            if on_close is not None:
                on_close(gen)

        gen = Generation(
            request_ids=request_ids,
            prompt_lengths=[len(p) for p in prompts],
            received_at=received_at,
            ticket=ticket,
            abort=engine_loop.abort,
            observe=observe,
            on_close=closed,
            undelivered=self.metrics.aborted_generation_tokens.inc,
        )
        self._active.add(gen)
        if self._idle is not None:
            self._idle.clear()
        for rid, tokens in zip(request_ids, prompts, strict=True):
            engine_loop.submit(Submission(rid, tokens, params, gen.sink))
        return gen

    def _observe(self, finish_reason: str, out: RequestOutput | None, received_at: float) -> None:
        self._finish_rate.note()
        if out is not None and finish_reason in ("stop", "length"):
            self.metrics.completed_generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        m = out.metrics if out is not None else None
        if m is None:
            self.metrics.observe_request(
                finish_reason=finish_reason, queue_s=None, ttft_s=None, e2e_s=None, tpot_s=None
            )
            return
        finished = m.finished_time if m.finished_time is not None else time.monotonic()
        longest = max((len(c.token_ids) for c in out.outputs), default=0) if out is not None else 0
        tpot = None
        if m.first_token_time is not None and longest > 1:
            tpot = (finished - m.first_token_time) / (longest - 1)
        self.metrics.observe_request(
            finish_reason=finish_reason,
            queue_s=None if m.first_scheduled_time is None else m.first_scheduled_time - received_at,
            ttft_s=None if m.first_token_time is None else m.first_token_time - received_at,
            e2e_s=finished - received_at,
            tpot_s=tpot,
        )

    @property
    def in_flight(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------ shutdown

    async def drain(self, timeout: float) -> DrainReport:
        """Stop admitting, give in-flight requests `timeout` s to finish, then abort the rest.

        Requests waiting for READY are turned away at once. Aborted streams get a last chunk with finish_reason
        "abort" (and `[DONE]`) before their connection closes.
        """
        self.lifecycle.begin_drain()
        started = len(self._active)
        if self._idle is None:
            return DrainReport(timeout, started, started, 0)
        log.info("draining", in_flight=started, timeout_s=timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return DrainReport(timeout, started, started, 0)
        except asyncio.TimeoutError:
            pass
        left = len(self._active)
        log.warning("drain timeout: aborting what is left", in_flight=left)
        if self._engine_loop is not None:
            self._engine_loop.abort_all(f"the server shut down after a {timeout:g} s drain")
        try:
            await asyncio.wait_for(self._idle.wait(), _ABORT_FLUSH_S)
        except asyncio.TimeoutError:
            for gen in list(self._active):
                gen.close()
        return DrainReport(timeout, started, started - left, left)

    def close(self) -> None:
        """Stop the engine loop and move to STOPPED; idempotent. Blocks up to a few seconds for the loop thread."""
        if self._engine_loop is not None:
            self._engine_loop.stop()
        group = getattr(self.startup_result, "parallel", None)
        if group is not None:
            group.close()  # every tensor-parallel rank stops with rank 0 (after the drain, the loop has stopped)
        snap = self.snapshot()
        if snap.state is not EngineState.STOPPED:
            if snap.state in (EngineState.READY, EngineState.STARTING):
                self.lifecycle.begin_drain()
            self.lifecycle.mark_stopped()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
