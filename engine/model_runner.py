"""Turn a scheduler decision into model inputs, run the model, and sample the next tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .attention import AttentionMetadata, PrefillChunk
from .kv_cache import KVCache
from .models.llama import DecoderLM
from .sampler import SampleResult, sample
from .scheduler import ScheduledSeq

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    order: list[ScheduledSeq]  # prefill chunks first, then decodes: the row order of the batch
    sample_rows: list[int]  # last row of each sequence that samples this step


class ModelRunner:
    def __init__(self, model: DecoderLM, kv_cache: KVCache, device: str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = torch.device(device)
        # Swapped for a compiled callable by the compile stages; eager by default.
        self.forward_fn: ForwardFn = model.forward

    def prepare(self, scheduled: list[ScheduledSeq]) -> BatchInputs:
        prefills = [s for s in scheduled if s.num_new_tokens > 1]
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        order = prefills + decodes
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        chunks: list[PrefillChunk] = []
        sample_rows: list[int] = []
        for s in order:
            seq, start, n = s.seq, s.start, s.num_new_tokens
            tokens = seq.all_token_ids[start : start + n]
            table = seq.block_table
            if n > 1:
                chunks.append(
                    PrefillChunk(
                        q_start=len(ids),
                        q_len=n,
                        ctx_len=start + n,
                        block_table=torch.tensor(table, dtype=torch.long, device=self.device),
                    )
                )
            ids.extend(tokens)
            for p in range(start, start + n):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            if s.samples:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata(
            prefills=chunks,
            num_prefill_tokens=sum(c.q_len for c in chunks),
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
        )
        if decodes:
            width = max(len(s.seq.block_table) for s in decodes)
            tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in decodes]
            meta.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=self.device)
            meta.decode_ctx_lens = torch.tensor([s.start + 1 for s in decodes], dtype=torch.long, device=self.device)
        return BatchInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(pos, dtype=torch.long, device=self.device),
            meta=meta,
            order=order,
            sample_rows=sample_rows,
        )

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> list[tuple[ScheduledSeq, SampleResult | None]]:
        batch = self.prepare(scheduled)
        hidden = self.forward_fn(batch.input_ids, batch.positions, batch.meta)
        samplers = [s for s in batch.order if s.samples]
        results: list[tuple[ScheduledSeq, SampleResult | None]] = [(s, None) for s in batch.order if not s.samples]
        if samplers:
            logits = self.model.compute_logits(hidden[batch.sample_rows])
            for s, r in zip(samplers, sample(logits, [s.seq for s in samplers])):
                results.append((s, r))
        return results
