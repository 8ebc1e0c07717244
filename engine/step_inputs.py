"""A step's rows on the runner's side, and the eager forward's inputs built from them: token ids, positions and the
attention metadata, prompt chunks first, then decode rows (engine/model_runner.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata
from .kv_cache import KVCache
from .scheduler import is_decode_row
from .sequence import RunnerSeq


@dataclass(slots=True)  # one per scheduled sequence per step: no per-object __dict__
class ScheduledSeq:
    """One row of a step on the runner's side: its copy of the sequence and how many tokens it runs."""

    seq: RunnerSeq
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Does this row take the decode path (engine/scheduler.py `is_decode_row`: a generated token, not a prompt's
        one-token chunk)?"""
        seq = self.seq
        return is_decode_row(seq.num_computed_tokens, len(seq.prompt_token_ids), self.num_new_tokens)

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the known tokens, so that it produces the next token?"""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[ScheduledSeq]  # prefill chunks first, then decodes: the row order of the batch
    sample_rows: list[int]  # last row of each sequence that samples this step


def pad_tables(tables: list[list[int]], width: int, fill: int, device: torch.device) -> torch.Tensor:
    rows = [t + [fill] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(tables), width)


def eager_inputs(
    scheduled: list[ScheduledSeq], block_size: int, scratch_block: int, kv_cache: KVCache, device: torch.device
) -> BatchInputs:
    """The eager forward's inputs for `scheduled`; block tables padded with `scratch_block`."""
    prefills = [s for s in scheduled if not s.is_decode]
    decodes = [s for s in scheduled if s.is_decode]
    order = prefills + decodes
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    info: list[tuple[int, int, int]] = []
    sample_rows: list[int] = []
    for s in order:
        seq, start, n = s.seq, s.start, s.num_new_tokens
        table = seq.block_table
        if not s.is_decode:
            info.append((len(ids), n, start + n))
        ids.extend(seq.token_slice(start, start + n))
        for p in range(start, start + n):
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        if s.samples:
            sample_rows.append(len(ids) - 1)
    dev = device
    ptables = [s.seq.block_table for s in prefills]
    meta = AttentionMetadata(
        prefill_info=torch.tensor(info, dtype=torch.long, device=dev).reshape(-1, 3),
        prefill_block_tables=pad_tables(ptables, max(map(len, ptables), default=0), scratch_block, dev),
        kv_cache=kv_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        prefill_rows=[list(r) for r in info],
    )
    if decodes:
        dtables = [s.seq.block_table for s in decodes]
        meta.decode_block_tables = pad_tables(dtables, max(2, *map(len, dtables)), scratch_block, dev)
        meta.decode_ctx_lens = torch.tensor([s.start + 1 for s in decodes], dtype=torch.long, device=dev)
    return BatchInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
        positions=torch.tensor(pos, dtype=torch.long, device=dev),
        meta=meta,
        order=order,
        sample_rows=sample_rows,
    )
