"""The asyncio side of one HTTP generation request: its engine requests (one per prompt), the events the core
client hands it, its admission ticket, and the per-request numbers that end up in metrics and the request span.

`close()` is the one place a request ends, whatever ended it (finished, client gone, error, cancelled): it aborts
what is still running in the engine, gives the admission slots back and reports the request's numbers once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeAlias

from glowplug.engine.outputs import RequestOutput


@dataclass(frozen=True)
class Scheduled:
    """The request's sequences have been scheduled for the first time: it has left the core's waiting queue."""

    request_id: str


@dataclass(frozen=True)
class Ended:
    """The request ended without a final RequestOutput: aborted by the server, refused by the core, or the core
    failed. `status` is the HTTP status a response that has not started yet should carry."""

    request_id: str
    finish_reason: str  # "abort" or "error"
    message: str
    status: int


# What a sink receives: Scheduled (once), RequestOutput (each step it advanced; the last has finished=True), or Ended.
EngineEvent: TypeAlias = "Scheduled | RequestOutput | Ended"
# Called on the event loop by the core client, in the order the core's frames arrive.
Sink = Callable[[EngineEvent], None]


class Ticket:
    """Admission slots held by one HTTP request: one per engine request until it is first scheduled, with that
    prompt's token count once it is known (`hold_tokens`), so the service knows the prompt work queued ahead."""

    def __init__(self, count: int, on_release: Callable[[int, int], None]) -> None:
        self._held = count
        self._tokens: list[int] = []  # prompt tokens of the held slots, once tokenized
        self._on_release = on_release

    @property
    def held(self) -> int:
        return self._held

    def hold_tokens(self, lengths: list[int]) -> None:
        self._tokens = list(lengths[: self._held])

    def release(self, count: int = 1) -> None:
        """Give back `count` slots. Which prompt's tokens go with them does not matter: the prompts of one request
        are scheduled together, and the service only keeps the total."""
        n = min(count, self._held)
        if n > 0:
            self._held -= n
            tokens = sum(self._tokens[:n])
            del self._tokens[:n]
            self._on_release(n, tokens)

    def release_all(self) -> None:
        self.release(self._held)


@dataclass
class GenerationStats:
    """What one HTTP request did, for its span, its access log line and the latency histograms."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_time_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    client_aborted: bool = False
    error: str | None = None

    @property
    def finish_reason(self) -> str:
        """One reason for the whole request: an error or abort wins, else the first completion's reason."""
        if self.error is not None:
            return "error"
        if self.client_aborted or "abort" in self.finish_reasons:
            return "abort"
        return self.finish_reasons[0] if self.finish_reasons else "abort"


@dataclass(frozen=True)
class PromptEvent:
    index: int  # which prompt of the HTTP request
    event: RequestOutput | Ended


class Generation:
    """Created by `Service.generate`; iterate `events()`, and always `close()` (responses do it in a finally)."""

    def __init__(
        self,
        *,
        request_ids: list[str],
        prompt_lengths: list[int],
        received_at: float,
        ticket: Ticket,
        abort: Callable[[str], None],
        observe: Callable[[str, RequestOutput | None], None],
        on_close: Callable[[Generation], None],
        undelivered: Callable[[int], None] = lambda _n: None,
    ) -> None:
        self.request_ids = request_ids
        self.received_at = received_at
        self.stats = GenerationStats(prompt_tokens=sum(prompt_lengths))
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._open = set(request_ids)
        self._ticket = ticket
        self._abort = abort
        self._observe = observe
        self._on_close = on_close
        self._undelivered = undelivered
        self._queue: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._closed = False
        # Aborted on close, but the engine may have finished them first (its final output still on the way):
        # such an output's tokens were generated for nobody, and are reported through `undelivered`.
        self._abandoned: set[str] = set()

    def sink(self, event: EngineEvent) -> None:
        """Called on the event loop by the core client, one step's events at a time."""
        if self._closed:
            self._count_if_abandoned(event)
            return
        self._queue.put_nowait(event)

    def _count_if_abandoned(self, event: EngineEvent) -> None:
        if isinstance(event, (Scheduled, Ended)) or not event.finished:
            return
        if event.request_id in self._abandoned:
            self._abandoned.discard(event.request_id)
            self._undelivered(sum(len(c.token_ids) for c in event.outputs))

    @property
    def has_pending(self) -> bool:
        """Events have arrived that `events()` has not yielded yet."""
        return not self._queue.empty()

    @property
    def done(self) -> bool:
        return not self._open

    async def events(self) -> AsyncIterator[PromptEvent]:
        """Outputs and ends of every prompt until all have finished (Scheduled events are handled here)."""
        while self._open:
            event = await self._queue.get()
            if isinstance(event, Scheduled):
                if event.request_id in self._open:
                    self._ticket.release(1)
                continue
            rid = event.request_id
            if rid not in self._open:
                continue
            if isinstance(event, Ended):
                self._finish(rid, None, event)
            elif event.finished:
                self._finish(rid, event, None)
            yield PromptEvent(self._index[rid], event)

    def _finish(self, rid: str, out: RequestOutput | None, ended: Ended | None) -> None:
        self._open.discard(rid)
        now = time.monotonic()
        if ended is not None:
            self.stats.finish_reasons.append(ended.finish_reason)
            if ended.finish_reason == "error":
                self.stats.error = ended.message
            self._observe(ended.finish_reason, None)
            return
        assert out is not None
        self.stats.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.stats.finish_reasons.extend(c.finish_reason or "abort" for c in out.outputs)
        m = out.metrics
        if m is not None:
            # Request-level numbers of the first prompt are the HTTP request's (a batch mostly shares them).
            if self.stats.queue_time_s is None and m.first_scheduled_time is not None:
                self.stats.queue_time_s = m.first_scheduled_time - self.received_at
            if self.stats.ttft_s is None and m.first_token_time is not None:
                self.stats.ttft_s = m.first_token_time - self.received_at
        self.stats.e2e_s = now - self.received_at
        reason = (out.outputs[0].finish_reason or "abort") if out.outputs else "abort"
        self._observe(reason, out)

    def close(self) -> None:
        """Abort what still runs, give back admission slots, report once. Safe to call repeatedly."""
        if self._closed:
            return
        self._closed = True
        if self._open:
            self.stats.client_aborted = True
            self._abandoned = set(self._open)
            while not self._queue.empty():  # outputs that arrived but were never read
                self._count_if_abandoned(self._queue.get_nowait())
            for rid in self._open:
                self._abort(rid)
                self._observe("abort", None)
            self._open.clear()
        self._ticket.release_all()
        self.stats.e2e_s = time.monotonic() - self.received_at
        self._on_close(self)
