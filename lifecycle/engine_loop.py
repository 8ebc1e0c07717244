"""The one thread that owns the LLMEngine: it adds, aborts and steps, and hands results to the asyncio side.

LLMEngine is not thread-safe, so nothing else may touch it once the loop runs. Other threads talk to the loop
through a command inbox (thread-safe queue) and hear back through per-request sinks: callables that run on the
asyncio side with the loop's events.

Events are handed over in one batch per engine step (one `post`, i.e. one `call_soon_threadsafe`, however many
streams advanced), not one hop per request: each hop wakes the event loop, and a loop that wakes 64 times per step
keeps taking the GIL back from this thread between the step's torch calls (each re-acquisition can wait out the
interpreter's 5 ms switch interval). One wake-up per step lets the event loop write every stream's chunk in one
burst and go back to sleep while the next step runs.

Commands are handled before every step, so an abort frees the request's KV blocks before the next forward pass:
a client that disconnects costs at most the step already running.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import structlog

from glowplug.engine.host_memory import release_free_heap
from glowplug.engine.sampling_params import SamplingParams

from .admission import PrefillCost
from .metrics import ServiceMetrics

if TYPE_CHECKING:
    from glowplug.engine.llm_engine import LLMEngine, RequestOutput

log = structlog.get_logger("glowplug.lifecycle.engine_loop")

# After this long without a step the engine counts as idle and trims the heap (malloc_trim walks every arena, so it
# waits for a lull rather than running between two closely spaced requests).
IDLE_TRIM_S = 1.0


@dataclass(frozen=True)
class Scheduled:
    """The request's sequences have been scheduled for the first time: it has left the waiting queue."""

    request_id: str


@dataclass(frozen=True)
class Ended:
    """The request ended without a final RequestOutput: aborted by the server, refused by the engine, or the engine
    failed. `status` is the HTTP status a response that has not started yet should carry."""

    request_id: str
    finish_reason: str  # "abort" or "error"
    message: str
    status: int


# What a sink receives: Scheduled (once), RequestOutput (each step it advanced; the last has finished=True), or Ended.
EngineEvent: TypeAlias = "Scheduled | RequestOutput | Ended"
# Called on the asyncio side (inside a `post`ed batch), never on the engine loop thread.
Sink = Callable[[EngineEvent], None]
# Runs a callable on the asyncio side: `loop.call_soon_threadsafe` of the serving event loop.
Post = Callable[[Callable[[], None]], object]


@dataclass(frozen=True)
class LoadSnapshot:
    """The engine's load as of the last step, for admission control (read from any thread; replaced whole)."""

    running_seqs: int
    waiting_seqs: int
    max_num_seqs: int
    # Prompt tokens still to compute for sequences the engine has started (chunked or preempted prompts).
    prefill_backlog: int = 0

    @property
    def free_seq_slots(self) -> int:
        return max(0, self.max_num_seqs - self.running_seqs - self.waiting_seqs)


def _dispatch(batch: list[tuple[Sink, EngineEvent]]) -> None:
    for sink, event in batch:
        sink(event)


@dataclass(frozen=True)
class Submission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: Sink


@dataclass(frozen=True)
class _Abort:
    request_id: str
    notify: bool  # tell the sink (server-side aborts); a client that went away needs no answer


@dataclass(frozen=True)
class _AbortAll:
    message: str


@dataclass(frozen=True)
class _Stop:
    message: str


class EngineLoop:
    """`start()` it once the engine is built; `stop()` aborts what is left and joins the thread."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        metrics: ServiceMetrics,
        on_crash: Callable[[BaseException], None],
        post: Post,
    ) -> None:
        self._engine = engine
        self._metrics = metrics
        self._on_crash = on_crash
        self._post = post
        self._outbox: list[tuple[Sink, EngineEvent]] = []
        stats = engine.stats()
        self.load = LoadSnapshot(0, 0, stats.max_num_seqs)
        self.prefill_cost = PrefillCost()
        self._inbox: queue.SimpleQueue[Submission | _Abort | _AbortAll | _Stop] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._unscheduled: set[str] = set()
        self._trim_pending = False
        self._thread = threading.Thread(target=self._run, name="glowplug-engine-loop", daemon=True)
        # Baselines: warm-up generations ran before the loop and are not traffic.
        self._prompt_seen = stats.num_prompt_tokens
        self._generated_seen = stats.num_generated_tokens

    # ------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread.start()

    def submit(self, submission: Submission) -> None:
        self._inbox.put(submission)

    def abort(self, request_id: str, *, notify: bool = False) -> None:
        self._inbox.put(_Abort(request_id, notify))

    def abort_all(self, message: str) -> None:
        """Abort every request in the engine; each sink gets Ended("abort")."""
        self._inbox.put(_AbortAll(message))

    def stop(self, message: str = "the server is shutting down", timeout: float | None = 10.0) -> None:
        """Abort whatever is still running, end the thread and wait for it (at most `timeout` seconds)."""
        if self._thread.is_alive():
            self._inbox.put(_Stop(message))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            self._publish()
            while self._handle_commands(block=not self._engine.has_unfinished()):
                self._flush()  # what the commands ended (aborts, refused requests) before the next step
                outputs = self._step() if self._engine.has_unfinished() else []
                self._hand_out(outputs)
            self._flush()
        except BaseException as exc:
            log.error("engine loop crashed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            # FAILED first: a client told "500" must find the server not ready when it looks.
            self._on_crash(exc)
            self._end_all("error", f"the engine failed: {type(exc).__name__}: {exc}", 500)
            self._flush()

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._trim_pending = True
        # A mixed step hands out the new prompts' first tokens before its decode part runs (LLMEngine.step).
        outputs = self._engine.step(on_partial=self._hand_out)
        seconds = time.perf_counter() - t0
        # Compared with the same step offline, this shows what serving costs the engine (GIL, CPU contention).
        self._metrics.engine_step.observe(seconds)
        shape = self._engine.last_step
        if self.prefill_cost.observe(shape.prefill_s, shape.prefill_tokens) and self.prefill_cost.fit is not None:
            self._metrics.set_prompt_cost(self.prefill_cost.fit.fixed_s, self.prefill_cost.fit.token_s)
        return outputs

    def _hand_out(self, outputs: list[RequestOutput]) -> None:
        """Send what a step (or the first part of one) produced to the asyncio side, in one hop."""
        self._note_scheduled()
        # Gauges and counters before the outputs: a client that has its answer sees metrics that include it.
        self._publish()
        for out in outputs:
            self._deliver(out)
        self._flush()

    def _emit(self, sink: Sink, event: EngineEvent) -> None:
        self._outbox.append((sink, event))

    def _flush(self) -> None:
        """Hand this step's events to the asyncio side in one hop."""
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        try:
            self._post(lambda: _dispatch(batch))
        except RuntimeError:
            pass  # the event loop is closed: nobody is left to tell

    def _next_command(self, block: bool) -> Submission | _Abort | _AbortAll | _Stop:
        """The next command (queue.Empty when there is none and `block` is False). An engine that has been idle for
        IDLE_TRIM_S since it last stepped gives the heap's free pages back to the OS, then sleeps on the inbox."""
        if not block:
            return self._inbox.get_nowait()
        if self._trim_pending:
            try:
                return self._inbox.get(timeout=IDLE_TRIM_S)
            except queue.Empty:
                self._trim_pending = False
                release_free_heap()
        return self._inbox.get()

    def _handle_commands(self, *, block: bool) -> bool:
        """Apply queued commands; False once told to stop. Blocks for the first one only when the engine is idle."""
        while True:
            try:
                cmd = self._next_command(block)
            except queue.Empty:
                return True
            block = False
            if isinstance(cmd, Submission):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                self._abort(cmd.request_id, "the request was aborted" if cmd.notify else None)
            elif isinstance(cmd, _AbortAll):
                self._end_all("abort", cmd.message, 503)
            elif isinstance(cmd, _Stop):
                self._end_all("abort", cmd.message, 503)
                self._publish()
                return False

    def _add(self, sub: Submission) -> None:
        try:
            self._engine.add_request(None, sub.params, prompt_token_ids=sub.prompt_token_ids, request_id=sub.request_id)
        except ValueError as exc:
            # The engine's own checks (e.g. more KV blocks than the cache has) are the client's to fix.
            self._emit(sub.sink, Ended(sub.request_id, "error", str(exc), 400))
            return
        self._sinks[sub.request_id] = sub.sink
        self._unscheduled.add(sub.request_id)

    def _count_aborted_tokens(self, request_id: str) -> None:
        status = self._engine.request_status(request_id)
        if status is not None and status.generated_tokens:
            self._metrics.aborted_generation_tokens.inc(status.generated_tokens)

    def _abort(self, request_id: str, notify_message: str | None) -> None:
        self._count_aborted_tokens(request_id)
        self._engine.abort(request_id)
        self._unscheduled.discard(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None and notify_message is not None:
            self._emit(sink, Ended(request_id, "abort", notify_message, 503))

    def _end_all(self, finish_reason: str, message: str, status: int) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self._count_aborted_tokens(request_id)
                self._engine.abort(request_id)
            except Exception:
                pass
            self._emit(sink, Ended(request_id, finish_reason, message, status))
        self._sinks.clear()
        self._unscheduled.clear()

    def _note_scheduled(self) -> None:
        for request_id in list(self._unscheduled):
            status = self._engine.request_status(request_id)
            # No status means it finished within the step that first scheduled it.
            if status is None or status.scheduled:
                self._unscheduled.discard(request_id)
                sink = self._sinks.get(request_id)
                if sink is not None:
                    self._emit(sink, Scheduled(request_id))

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return  # aborted by its client in the meantime
        if out.finished:
            del self._sinks[out.request_id]
        self._emit(sink, out)

    def _publish(self) -> None:
        stats = self._engine.stats()
        self.load = LoadSnapshot(
            stats.running_seqs, stats.waiting_seqs, stats.max_num_seqs, prefill_backlog=stats.prefill_backlog
        )
        self._metrics.set_engine_gauges(
            running=stats.running_requests, used_blocks=stats.kv_used_blocks, total_blocks=stats.kv_blocks
        )
        prompt, generated = stats.num_prompt_tokens, stats.num_generated_tokens
        if prompt > self._prompt_seen:
            self._metrics.prompt_tokens.inc(prompt - self._prompt_seen)
        if generated > self._generated_seen:
            self._metrics.generation_tokens.inc(generated - self._generated_seen)
        self._prompt_seen, self._generated_seen = prompt, generated
