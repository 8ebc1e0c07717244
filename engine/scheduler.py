"""Continuous batching with chunked prefill and preemption by recompute; the one owner of every sequence's state.

Every step gets a token budget (`max_num_batched_tokens`). Running sequences are served first, in arrival order:
one token each when decoding, the next chunk of the prompt when still prefilling. When the KV cache runs out, the
most recently arrived running sequence is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to be recomputed later (FIFO fairness: the oldest requests keep making progress). Then waiting
sequences are admitted in arrival order while budget, blocks and `max_num_seqs` allow.

One step, one owner: `schedule()` decides the step and returns it as plain data (`SchedulerOutput`): the sequences
the runner has not seen (whole), the rows it already holds (how many tokens each runs, and only the block-table
entries added since the last step), and the sequences it should forget. The runner applies that to its own
persistent batch and returns plain data too (`ModelRunnerOutput`: the sampled tokens). `update_from_output` alone
then moves the sequences on: it books the computed tokens, appends the sampled ones, decides stop tokens, EOS and
the length limits, and frees the blocks of what finished. Nothing outside the scheduler changes a `Sequence`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from .block_manager import BlockManager
from .config import CacheConfig, SchedulerConfig
from .outputs import GRAMMAR_DONE, ModelRunnerOutput, SeqUpdate, TokenLogprobs
from .sampling_params import SamplingParams
from .sequence import SeqStatus, Sequence
from .structured import GrammarBackend, advance


def is_decode_row(num_computed_tokens: int, prompt_len: int, num_new_tokens: int) -> bool:
    """Does a row compute a generated token (one new token, past the prompt)? A prompt's chunk is no decode row
    even when it is one token long (a prompt whose earlier tokens the prefix cache held): it runs the prompt path,
    so that its arithmetic is the same as when the whole prompt runs at once. The scheduler counts its decode rows
    and the runner splits its step by this one rule."""
    return num_new_tokens == 1 and num_computed_tokens >= prompt_len


class NewSeqData(msgspec.Struct, array_like=True, gc=False):
    """A sequence the runner does not hold yet (first scheduled, or resumed after a preemption): all it needs."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before a preemption (the sampler's draw counter and penalties read them)
    params: SamplingParams
    sample_key: int | None
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits: the runner starts after them


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):
    """One step, as plain data (see the module docstring)."""

    seq_ids: list[int] = msgspec.field(default_factory=list)  # every row of the step, in the step's order
    num_new_tokens: list[int] = msgspec.field(default_factory=list)  # parallel to seq_ids
    new_seqs: list[NewSeqData] = msgspec.field(default_factory=list)
    new_block_ids: dict[int, list[int]] = msgspec.field(default_factory=dict)  # rows the runner holds that grew
    finished_seq_ids: list[int] = msgspec.field(default_factory=list)  # forget: finished, aborted or preempted
    first_scheduled: list[str] = msgspec.field(default_factory=list)  # requests that left the waiting queue
    num_preempted: int = 0
    num_prefill_tokens: int = 0  # new tokens of the prompt rows (prompt chunks, even of one token)
    num_decode_rows: int = 0  # rows that compute a generated token (see `is_decode_row`)
    # Constrained rows that sample this step, and their token masks (engine/structured.py): row j of the int32
    # bitmask [len(grammar_seq_ids), words] is what grammar_seq_ids[j] may sample, as a Future (computed while the
    # step's forward runs: GrammarBackend.fill_bitmask_async). Empty without constrained rows.
    grammar_seq_ids: list[int] = msgspec.field(default_factory=list)
    grammar_bitmask: Any = None

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_rows

    @property
    def empty(self) -> bool:
        return not self.seq_ids


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


class Scheduler:
    def __init__(
        self,
        sched: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.cfg = sched
        # Running sequences with a grammar: a step looks for rows to mask only while there are any.
        self._num_constrained = 0
        self._grammar: GrammarBackend | None = None
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._block_manager = BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self._block_size = cache.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # The step scheduled last and not yet booked: seq_id -> (sequence, new tokens). update_from_output reads it.
        self._inflight: dict[int, tuple[Sequence, int]] = {}
        # Sequences the runner holds that left since the last step (finished, aborted): the next output says so.
        self._dropped: list[int] = []

    def use_grammars(self, backend: GrammarBackend) -> None:
        """Fill the token masks of constrained rows with `backend` (the engine core's; see engine/structured.py)."""
        self._grammar = backend

    def add(self, seq: Sequence) -> None:
        # The request was checked (outputs.check_request); start-up guarantees one max-model-len sequence fits.
        self.waiting.append(seq)
        if seq.grammar is not None:
            self._num_constrained += 1

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

    def _forget(self, seq: Sequence) -> None:
        """The runner must drop its copy of `seq` (it left, or will come back whole after a preemption)."""
        if seq.in_runner:
            seq.in_runner = False
            seq.num_sent_blocks = 0
            self._dropped.append(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self._block_manager.free_seq(seq)
        self._forget(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _row(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Add `seq` running `n` tokens to the step: whole when the runner does not hold it, else its new blocks."""
        sid = seq.seq_id
        out.seq_ids.append(sid)
        out.num_new_tokens.append(n)
        self._inflight[sid] = (seq, n)
        table = seq.block_table
        if not seq.in_runner:
            seq.in_runner = True
            seq.num_sent_blocks = len(table)
            out.new_seqs.append(
                NewSeqData(
                    sid,
                    seq.request_id,
                    seq.prompt_token_ids,
                    list(seq.output_token_ids),
                    seq.params,
                    seq.sample_key,
                    list(table),
                    seq.num_computed_tokens,
                )
            )
        elif len(table) != seq.num_sent_blocks:
            out.new_block_ids[sid] = table[seq.num_sent_blocks :]
            seq.num_sent_blocks = len(table)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._inflight = {}
        budget = self.cfg.max_num_batched_tokens
        bm = self._block_manager
        now = time.monotonic()

        bs = bm.block_size
        decode_rows = 0
        preempted = 0
        # The running sequences' rows, inlined from _row: this loop runs once per decoding sequence per step.
        inflight = self._inflight
        seq_ids, num_new = out.seq_ids, out.num_new_tokens
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # Most steps a decoding sequence's last block still has room: no call into the block manager.
            table = seq.block_table
            while len(table) * bs < seq.num_computed_tokens + n and not bm.allocate(seq, n):
                victim = running.pop()  # the newest arrival
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                if seq.in_runner:
                    sid = seq.seq_id
                    seq_ids.append(sid)
                    num_new.append(n)
                    inflight[sid] = (seq, n)
                    table = seq.block_table
                    if len(table) != seq.num_sent_blocks:
                        out.new_block_ids[sid] = table[seq.num_sent_blocks :]
                        seq.num_sent_blocks = len(table)
                else:
                    self._row(seq, n, out)
                budget -= n
                if n == 1 and seq.num_computed_tokens >= len(seq.prompt_token_ids):  # is_decode_row, inlined
                    decode_rows += 1
                i += 1
                continue
            break  # `seq` itself was preempted: nothing after it is left either

        # After a preemption the cache is full: admitting newcomers now would only thrash.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                bm.allocate_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not self.cfg.enable_chunked_prefill:
                break
            if not bm.allocate(seq, n):
                if not self.running and not out.seq_ids:
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
                if seq.index == 0:
                    out.first_scheduled.append(seq.request_id)
            self.running.append(seq)
            self._row(seq, n, out)
            budget -= n
            if is_decode_row(seq.num_computed_tokens, len(seq.prompt_token_ids), n):
                decode_rows += 1
        out.finished_seq_ids, self._dropped = self._dropped, []
        if self._num_constrained:
            self._masks(out)
        out.num_preempted = preempted
        out.num_decode_rows = decode_rows
        out.num_prefill_tokens = self.cfg.max_num_batched_tokens - budget - decode_rows
        return out

    def _masks(self, out: SchedulerOutput) -> None:
        """The token masks of the step's constrained rows that sample (the ones reaching the end of their tokens)."""
        assert self._grammar is not None
        matchers = []
        for sid, n in zip(out.seq_ids, out.num_new_tokens):
            seq = self._inflight[sid][0]
            if seq.grammar is not None and seq.num_computed_tokens + n == seq.num_tokens:
                out.grammar_seq_ids.append(sid)
                matchers.append(seq.grammar)
        if matchers:
            out.grammar_bitmask = self._grammar.fill_bitmask_async(matchers)

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[SeqUpdate]:
        """Book what the runner computed for (a part of) the step `out`: every row's computed tokens, the sampled
        token of each row that sampled one, and the stops those decide (a stop token or EOS: "stop"; max_tokens or
        max-model-len: "length"), freeing the finished sequences' blocks. Returns one update per sampled row. A
        row whose sequence finished meanwhile (aborted between schedule and now) is skipped. This runs once per
        row per step, so what it reads repeatedly is bound to locals first."""
        if out.grammar_bitmask is not None:
            out.grammar_bitmask.result()  # the masks are read from the matchers this advances: let them finish
        inflight, eos, max_len = self._inflight, self.eos_token_ids, self.max_model_len
        block_size = self._block_size
        commit = self._block_manager.commit
        logprobs: list[TokenLogprobs | None] | None = result.logprobs
        updates: list[SeqUpdate] = []
        finished = SeqStatus.FINISHED
        for row, (sid, token) in enumerate(zip(result.seq_ids, result.token_ids)):
            seq, n = inflight[sid]
            if seq.status is finished:
                continue
            computed = seq.num_computed_tokens = seq.num_computed_tokens + n
            if computed >= (seq.num_committed_blocks + 1) * block_size:  # a block filled up: publish its hash
                commit(seq)
            if token < 0:
                continue  # a prompt chunk short of the end: nothing sampled
            output = seq.output_token_ids
            output.append(token)
            p = seq.params
            reason = None
            if token in p.stop_token_ids or (token in eos and not p.ignore_eos):
                reason = "stop"
            elif seq.grammar is not None and advance(seq.grammar, token):
                reason = GRAMMAR_DONE  # the grammar is complete: nothing else may follow
            elif len(output) >= p.max_tokens or len(seq.prompt_token_ids) + len(output) >= max_len:
                reason = "length"
            if reason is not None:
                self.finish(seq, reason)
            updates.append(
                SeqUpdate(
                    seq.request_id,
                    seq.index,
                    token,
                    None if logprobs is None else logprobs[row],
                    reason,
                    seq.num_cached_tokens,
                )
            )
        return updates

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` now (a no-op when it already ended); its KV blocks are free when this returns."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq.grammar is not None:
            self._num_constrained -= 1
        self._block_manager.free_seq(seq)
        self._forget(seq)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, seq: Sequence) -> None:
        self.finish(seq, "abort")
