"""Turn a scheduler decision into model inputs, run the model, and sample the next tokens.

Decode-only batches can run through a compiled step (set by the compile stages), for batch sizes up to the largest
one warmed at start-up. With `pad_decode` (CUDA graphs: fixed shapes) a batch is padded up to the next captured
size; the CPU graph has a symbolic batch size and needs no padding. Padding rows write their keys and values into
a scratch block that the block manager never hands out. Block tables are at least two blocks wide, so a short
context never hits a width-1 specialisation of the graph.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

from .attention import AttentionMetadata
from .kv_cache import KVCache
from .models.llama import DecoderLM
from .sampler import SampleResult, sample
from .scheduler import ScheduledSeq

# (input_ids [B], positions [B], metadata) -> logits [B, vocab]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[ScheduledSeq]  # prefill chunks first, then decodes: the row order of the batch
    sample_rows: list[int]  # last row of each sequence that samples this step
    num_real_rows: int  # rows after this are padding


def _pad_tables(tables: list[list[int]], width: int, fill: int) -> torch.Tensor:
    return torch.tensor([t + [fill] * (width - len(t)) for t in tables], dtype=torch.long).reshape(len(tables), width)


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: KVCache, device: str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.scratch_block = kv_cache.num_blocks - 1  # reserved: see module docstring
        self.device = torch.device(device)
        self.decode_fn: DecodeFn | None = None
        self.decode_sizes: list[int] = []  # batch sizes the compiled decode step was warmed for
        self.pad_decode = self.device.type == "cuda"
        self.min_decode_batch = 1

    def eager_decode(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, meta))

    def padded_size(self, batch: int) -> int | None:
        """The batch size to run a decode batch at through the compiled step, or None for eager."""
        i = bisect.bisect_left(self.decode_sizes, batch)
        if i == len(self.decode_sizes):
            return None
        # The CPU graph is traced at batch >= 2; a lone sequence gets one padding row rather than a second graph
        # (decode is memory-bound: the extra row costs next to nothing).
        return self.decode_sizes[i] if self.pad_decode else max(batch, self.min_decode_batch)

    def prepare(self, scheduled: list[ScheduledSeq], pad_to: int | None = None) -> BatchInputs:
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        order = prefills + decodes
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        info: list[tuple[int, int, int]] = []
        sample_rows: list[int] = []
        for s in order:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            table = seq.block_table
            if n > 1:
                info.append((len(ids), n, start + n))
            ids.extend(seq.all_token_ids[start : start + n])
            for p in range(start, start + n):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            if s.samples:
                sample_rows.append(len(ids) - 1)
        real = len(ids)
        dtables = [s.seq.block_table for s in decodes]
        dlens = [s.start + 1 for s in decodes]
        for _ in range((pad_to or 0) - len(decodes)):
            ids.append(0)
            pos.append(0)
            slots.append(self.scratch_block * bs)
            dtables.append([self.scratch_block])
            dlens.append(1)
        ptables = [s.seq.block_table for s in prefills]
        meta = AttentionMetadata(
            prefill_info=torch.tensor(info, dtype=torch.long).reshape(-1, 3),
            prefill_block_tables=_pad_tables(ptables, max(map(len, ptables), default=0), self.scratch_block),
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long),
        )
        if dtables:
            meta.decode_block_tables = _pad_tables(dtables, max(2, *map(len, dtables)), self.scratch_block)
            meta.decode_ctx_lens = torch.tensor(dlens, dtype=torch.long)
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(pos, dtype=torch.long),
            meta=meta,
            order=order,
            sample_rows=sample_rows,
            num_real_rows=real,
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> list[tuple[ScheduledSeq, SampleResult | None]]:
        decode_only = all(s.num_new_tokens == 1 for s in scheduled)
        padded = self.padded_size(len(scheduled)) if decode_only and self.decode_fn is not None else None
        batch = self.prepare(scheduled, pad_to=padded)
        samplers = [s for s in batch.order if s.samples]
        if padded is not None:
            assert self.decode_fn is not None
            logits = self.decode_fn(batch.input_ids, batch.positions, batch.meta)[batch.sample_rows]
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
            logits = self.model.compute_logits(hidden[batch.sample_rows]) if samplers else None
        results: list[tuple[ScheduledSeq, SampleResult | None]] = [(s, None) for s in batch.order if not s.samples]
        if samplers and logits is not None:
            for s, r in zip(samplers, sample(logits, [s.seq for s in samplers])):
                results.append((s, r))
        return results
