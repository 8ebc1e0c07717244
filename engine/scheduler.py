"""Continuous batching with chunked prefill and preemption by recompute.

Every step gets a token budget (`max_num_batched_tokens`). Running sequences are served first, in arrival order:
one token each when decoding, the next chunk of the prompt when still prefilling. When the KV cache runs out, the
most recently arrived running sequence is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to be recomputed later (FIFO fairness: the oldest requests keep making progress). Then waiting
sequences are admitted in arrival order while budget, blocks and `max_num_seqs` allow.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .config import CacheConfig, SchedulerConfig
from .block_manager import BlockManager
from .sequence import Sequence, SeqStatus


@dataclass(slots=True)  # one per scheduled sequence per step: no per-object __dict__
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Does this row compute a generated token (one new token, past the prompt)? A prompt's chunk is no decode
        row even when it is one token long (a prompt whose earlier tokens the prefix cache held): it runs the prompt
        path, so that its arithmetic is the same as when the whole prompt runs at once."""
        return self.num_new_tokens == 1 and self.seq.num_computed_tokens >= len(self.seq.prompt_token_ids)

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the known tokens, so that it produces the next token?"""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's queues and its KV cache, as of one moment."""

    running_seqs: int
    waiting_seqs: int
    running_requests: int  # distinct requests among the running sequences
    max_num_seqs: int
    prefill_backlog: int  # see Scheduler.prefill_backlog
    num_preemptions: int
    kv_blocks: int
    kv_free_blocks: int
    block_size: int
    prefix_queries: int  # full blocks looked up in the prefix cache
    prefix_hits: int  # of those, found


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0  # new tokens of the rows with more than one (prompt chunks)
    num_decode_rows: int = 0  # rows with exactly one new token

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_rows

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, num_blocks: int, max_model_len: int) -> None:
        self.cfg = sched
        self.max_model_len = max_model_len
        self._block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self._block_size = cache.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        # LLMEngine.validate_request has checked the length; start-up guarantees one max-model-len sequence fits.
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def prefill_backlog(self) -> int:
        """Prompt tokens still to compute for sequences already started: the rest of chunked prompts, and
        preempted sequences that will be recomputed. (Never-scheduled arrivals are the caller's to count.)"""
        running = sum(max(0, s.num_tokens - s.num_computed_tokens - 1) for s in self.running)
        resumed = sum(s.num_tokens - s.num_computed_tokens for s in self.waiting if s.first_scheduled_time is not None)
        return running + resumed

    def stats(self) -> SchedulerStats:
        bm = self._block_manager
        return SchedulerStats(
            running_seqs=len(self.running),
            waiting_seqs=len(self.waiting),
            running_requests=len({s.request_id for s in self.running}),
            max_num_seqs=self.cfg.max_num_seqs,
            prefill_backlog=self.prefill_backlog(),
            num_preemptions=self.num_preemptions,
            kv_blocks=bm.num_blocks,
            kv_free_blocks=bm.num_free_blocks,
            block_size=bm.block_size,
            prefix_queries=bm.prefix_queries,
            prefix_hits=bm.prefix_hits,
        )

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self._block_size

    def commit(self, seq: Sequence) -> None:
        """After a step computed `seq`'s tokens: publish its blocks that are now full to the prefix cache."""
        # Called for every row of every step, and most steps fill no block: that case returns without a call.
        if seq.num_computed_tokens >= (seq.num_committed_blocks + 1) * self._block_size:
            self._block_manager.commit(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._block_manager.free_seq(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        bm = self._block_manager
        now = time.monotonic()

        bs = bm.block_size
        decode_rows = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # Most steps a decoding sequence's last block still has room: no call into the block manager.
            while len(seq.block_table) * bs < seq.num_computed_tokens + n and not bm.allocate(seq, n):
                victim = self.running.pop()  # the newest arrival
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                if n == 1:
                    decode_rows += 1
                i += 1
                continue
            break  # `seq` itself was preempted: nothing after it is left either

        # After a preemption the cache is full: admitting newcomers now would only thrash.
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                bm.allocate_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.cfg.enable_chunked_prefill:
                break
            if not bm.allocate(seq, n):
                if not self.running and not out.scheduled:
                    # Nothing else holds blocks; shrink the chunk to what fits rather than stall forever.
                    fit = bm.num_free_blocks * bm.block_size + len(seq.block_table) * bm.block_size
                    n = fit - seq.num_computed_tokens
                    if n <= 0 or not bm.allocate(seq, n):
                        bm.free_seq(seq)
                        break
                else:
                    # Give back prefix blocks so waiting does not pin cache memory.
                    bm.free_seq(seq)
                    break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if n == 1:
                decode_rows += 1
        out.num_decode_rows = decode_rows
        out.num_prefill_tokens = self.cfg.max_num_batched_tokens - budget - decode_rows
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._block_manager.free_seq(seq)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.finish(seq, "abort")
