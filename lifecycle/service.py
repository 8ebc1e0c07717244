"""The server's side of one engine: three owners, and the one way a request goes through them.

- progress (lifecycle/progress.py): the life-cycle state, the start-up's phases, ETA and phase table: what
  /health/ready, /startup, the live page, its events and the terminal show;
- admission (lifecycle/admission.py): who may come in (503 / 429 with Retry-After), from the core's reported state;
- the core client (lifecycle/core_client.py): the engine core (a process of its own), requests to it, text and
  events back.

A request goes one way: HTTP (lifecycle/openai_api.py, transport limits and validation) -> `admission.admit` ->
`wait_ready` -> tokenize -> `admission.admit_prompts` -> `generate` (the core client) -> the Generation's events ->
the response. This class ties them together and owns what spans them: the requests in flight and the drain.
Everything here runs on the asyncio event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from glowplug.engine.config import EngineConfig
from glowplug.engine.core_proc import EngineFactory
from glowplug.engine.generation_config import SamplingDefaults, sampling_defaults
from glowplug.engine.sampling_params import SamplingParams
from glowplug.profiling.process import ProcessMarks
from glowplug.profiling.tracing import Tracing, setup_tracing

from .admission import Admission, Rejected
from .config import ServeConfig
from .core_client import CoreClient, EngineInfo, StepReport
from .generation import Generation, Ticket
from .metrics import ServiceMetrics
from .progress import Progress
from .state import EngineState, StateSnapshot

if TYPE_CHECKING:
    from glowplug.engine.outputs import RequestOutput
    from glowplug.profiling.progress import StartupProgress

__all__ = ["DrainReport", "EngineInfo", "Rejected", "Service"]

log = structlog.get_logger("glowplug.lifecycle.service")

# After a drain gives up and aborts what is left, how long the responses get to send their last chunk.
_ABORT_FLUSH_S = 5.0


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
        display: StartupProgress | None = None,
        log_json: bool | None = None,
        quiet_stages: bool = False,
    ) -> None:
        """engine_factory: build the engine with this (tests, embedders) on a core thread of this process instead of
        starting the core process. display: the terminal's progress lines (`glowplug serve` on a terminal)."""
        self.config = config
        self.serve_cfg = serve_cfg
        self.model_name = serve_cfg.model_name(config.model)
        # The names a request's `model` may give (the served name first).
        self.model_names = serve_cfg.model_names(config.model)
        # What a request's unset sampling fields become: the model's generation config, else glowplug's default
        # (greedy), the same as `glowplug generate` uses; logged at start and shown in /v1/models.
        self.sampling_defaults: SamplingDefaults = sampling_defaults(config.model)
        self.metrics = metrics or ServiceMetrics()
        # The start-up's spans (the server's and, forwarded, the core's) are kept for the phases and the downloads.
        self.tracing = tracing or setup_tracing("glowplug", in_memory=True)
        self.progress = Progress(
            self.tracing, marks=marks, display=display, world_size=config.tensor_parallel_size, metrics=self.metrics
        )
        self.core = CoreClient(
            config,
            serve_cfg,
            progress=self.progress,
            metrics=self.metrics,
            factory=engine_factory,
            marks=marks,
            log_json=log_json,
            quiet_stages=quiet_stages,
        )
        self.admission = Admission(
            serve_cfg,
            self.metrics,
            state=self.progress.snapshot,
            eta_s=self.progress.eta_s,
            load=lambda: self.core.load,
        )
        self.core.on_step = self._step_done
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._active: set[Generation] = set()
        self._idle: asyncio.Event | None = None
        self._unsubscribe: Callable[[], None] | None = None

    # ------------------------------------------------------------ start and state

    def start(self) -> None:
        """Start the engine core; call on the event loop that serves the requests."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._unsubscribe = self.progress.lifecycle.subscribe(self._state_changed)
        log.info(
            "sampling defaults",
            model=self.model_name,
            source=self.sampling_defaults.source,
            **self.sampling_defaults.values,
        )
        self.core.start()

    def snapshot(self) -> StateSnapshot:
        return self.progress.snapshot()

    @property
    def engine_info(self) -> EngineInfo | None:
        return self.core.engine_info

    def _state_changed(self, snap: StateSnapshot) -> None:
        # Any thread. Metrics are thread-safe; the asyncio wake-up is not, so it hops over.
        self.metrics.set_state(snap.state)
        if snap.state is not EngineState.STARTING:
            self.metrics.set_phase_durations(self.progress.phase_row_seconds(snap))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake_waiters)
            except RuntimeError:
                pass  # the loop closed between the check and the call

    def _wake_waiters(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        if old is not None:
            old.set()

    def _step_done(self, report: StepReport) -> None:
        self.admission.observe_step(report)

    async def wait_ready(self, timeout: float) -> EngineInfo:
        """Wait (at most `timeout` s) until READY; Rejected(503) on timeout, failure or drain."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.snapshot()
            info = self.core.engine_info
            if snap.state is EngineState.READY and info is not None:
                return info
            rejection = self.admission.rejection_for_state(snap)
            remaining = deadline - time.monotonic()
            if rejection is None and remaining <= 0:
                phase = self.progress.phase_text(snap) or snap.state.value
                rejection = Rejected(
                    503,
                    f"the engine is starting (phase: {phase}); not ready after waiting {timeout:g} s",
                    "not_ready",
                    retry_after=self.admission.retry_after(snap),
                )
            if rejection is not None:
                raise self.admission.reject(rejection)
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
        core = self.core
        if not core.alive or core.engine_info is None or self.snapshot().state is EngineState.FAILED:
            ticket.release_all()
            reason = self.snapshot().reason
            raise self.admission.reject(
                Rejected(503, f"the engine is not running{': ' + reason if reason else ''}", "failed")
            )
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
            abort=core.abort,
            observe=observe,
            on_close=closed,
            undelivered=self.metrics.aborted_generation_tokens.inc,
        )
        self._active.add(gen)
        if self._idle is not None:
            self._idle.clear()
        for rid, tokens in zip(request_ids, prompts, strict=True):
            core.submit(rid, tokens, params, gen.sink, received_at)
        return gen

    def _observe(self, finish_reason: str, out: RequestOutput | None, received_at: float) -> None:
        if out is not None and finish_reason in ("stop", "length"):
            self.admission.note_finished([(len(c.token_ids), c.finish_reason != "length") for c in out.outputs])
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
        self.progress.lifecycle.begin_drain()
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
        self.core.abort_all(f"the server shut down after a {timeout:g} s drain")
        try:
            await asyncio.wait_for(self._idle.wait(), _ABORT_FLUSH_S)
        except asyncio.TimeoutError:
            for gen in list(self._active):
                gen.close()
        return DrainReport(timeout, started, started - left, left)

    async def close(self) -> None:
        """Stop the engine core (it exits once told; killed if it does not) and move to STOPPED; idempotent."""
        await self.core.stop()
        self.progress.close()
        snap = self.snapshot()
        lifecycle = self.progress.lifecycle
        if snap.state is not EngineState.STOPPED:
            if snap.state in (EngineState.READY, EngineState.STARTING):
                lifecycle.begin_drain()
            lifecycle.mark_stopped()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
