"""Attention over a paged KV cache, in plain torch.

One engine step carries a flattened batch: the prefill chunks come first (each sequence's new tokens), then one
token per decoding sequence. Prefill chunks are attended one sequence at a time (their shapes differ); decodes are
attended together, over keys gathered from each sequence's blocks and padded to the longest context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .kv_cache import KVCache


@dataclass
class PrefillChunk:
    q_start: int  # row of the chunk's first token in the flattened batch
    q_len: int
    ctx_len: int  # tokens in the cache for this sequence once this chunk is written
    block_table: torch.Tensor | None  # [num_blocks] int64; None when there is no cache


@dataclass
class AttentionMetadata:
    prefills: list[PrefillChunk] = field(default_factory=list)
    num_prefill_tokens: int = 0
    kv_cache: KVCache | None = None
    slot_mapping: torch.Tensor | None = None  # [T] int64: cache slot for each new token
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int64, padded with block 0
    decode_ctx_lens: torch.Tensor | None = None  # [B] int64

    @property
    def num_decodes(self) -> int:
        return 0 if self.decode_ctx_lens is None else int(self.decode_ctx_lens.shape[0])

    @classmethod
    def causal(cls, lengths: list[int]) -> AttentionMetadata:
        """Cache-less prefill of independent sequences (reference checks, perplexity, profiling runs)."""
        chunks, start = [], 0
        for n in lengths:
            chunks.append(PrefillChunk(q_start=start, q_len=n, ctx_len=n, block_table=None))
            start += n
        return cls(prefills=chunks, num_prefill_tokens=start)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kw: object) -> torch.Tensor:
    # q: [B, H, Tq, D], k/v: [B, Hkv, Tk, D]; GQA is handled inside SDPA without materialising repeated heads.
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1], **kw)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] for the new tokens. Returns [T, H, D]."""
    cache = meta.kv_cache
    if cache is not None and meta.slot_mapping is not None:
        cache.store(layer, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    for chunk in meta.prefills:
        rows = slice(chunk.q_start, chunk.q_start + chunk.q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)
        if chunk.ctx_len == chunk.q_len or cache is None:
            # Nothing cached before this chunk: the fresh keys are the whole context, plain causal attention.
            ks, vs = k[rows], v[rows]
            o = _sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), scale, is_causal=True)
        else:
            assert chunk.block_table is not None
            ks, vs = cache.gather(layer, chunk.block_table, chunk.ctx_len)
            # The chunk's queries sit at the end of the context: query i may see keys up to ctx - q_len + i.
            offset = chunk.ctx_len - chunk.q_len
            qi = torch.arange(chunk.q_len, device=q.device)[:, None]
            kj = torch.arange(chunk.ctx_len, device=q.device)[None, :]
            mask = kj <= qi + offset
            o = _sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), scale, attn_mask=mask)
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.num_decodes:
        assert cache is not None and meta.decode_block_tables is not None and meta.decode_ctx_lens is not None
        p = meta.num_prefill_tokens
        qd = q[p:].unsqueeze(2)  # [B, H, 1, D]
        kd, vd = cache.gather_batch(layer, meta.decode_block_tables)  # [B, L, Hkv, D]
        L = kd.shape[1]
        mask = (torch.arange(L, device=q.device)[None, :] < meta.decode_ctx_lens[:, None])[:, None, None, :]
        o = _sdpa(qd, kd.transpose(1, 2), vd.transpose(1, 2), scale, attn_mask=mask)
        out[p:] = o.squeeze(2)
    return out
