"""A generated sequence as each side of the step holds it.

`Sequence` is the scheduler's record: its tokens, its place in the KV cache and its progress. Only the scheduler
changes it (`Scheduler.schedule` allocates, `Scheduler.update_from_output` advances, appends and finishes).
`RunnerSeq` is the model runner's own copy of what it needs to build inputs and sample (engine/model_runner.py):
made from the scheduler's output when the sequence is first scheduled (or resumed after a preemption), then kept
up to date from the deltas of each step and the tokens the runner sampled itself. Neither side reads the other's.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .outputs import TokenLogprobs
from .sampling_params import SamplingParams

__all__ = ["RunnerSeq", "SeqStatus", "Sequence", "TokenLogprobs"]


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class _Tokens:
    """Token access shared by both records (prompt_token_ids + output_token_ids)."""

    __slots__ = ()
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def all_token_ids(self) -> list[int]:
        """A new list of every token (O(length): not for per-step paths; see token_slice / last_token_id)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) without building the whole sequence."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


# eq=False: identity semantics (queues look sequences up with `in` and `remove`). slots: the engine touches every
# running sequence several times a step, and a slotted object is one compact block rather than an object and a dict.
@dataclass(eq=False, slots=True)
class Sequence(_Tokens):
    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    # The 64-bit key of this sequence's sampling stream (sampler.key_for_seed of the request's seed, or of a number
    # drawn from the engine's generator when it has none); its t-th sampled token uses draw t of that stream
    # (sampler.row_uniform), so what it samples depends on nothing else in its batch. None: never sampled.
    sample_key: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks so far
    num_computed_tokens: int = 0  # tokens whose KV are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    num_committed_blocks: int = 0  # leading full blocks whose hashes the block manager has published
    # What the runner holds of it: whether it has the sequence (sent whole, not dropped since), and how many
    # block-table entries it was sent; the entries after those go out as the next step's delta.
    in_runner: bool = False
    num_sent_blocks: int = 0
    # The grammar matcher of a constrained request (engine/structured.py; an llguidance.LLMatcher), at the state
    # after this sequence's output so far; None when the request has no grammar.
    grammar: Any = None

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False, slots=True)
class RunnerSeq(_Tokens):
    """The runner's copy of one scheduled sequence (see the module docstring)."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    sample_key: int | None
    block_table: list[int]
    num_computed_tokens: int
