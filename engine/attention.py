"""Attention over the paged KV cache: plain torch everywhere, and on CUDA a Triton paged kernel for the decodes.

Eager (`paged_attention`, used for prefill chunks and mixed batches): one engine step carries a flattened batch, the
prefill chunks first (each sequence's new tokens), then one token per decoding sequence. Prefill chunks are attended
one sequence at a time (their shapes differ). Decodes are attended together: on CUDA by the Triton kernel, which
reads each row's blocks through its table up to its own context length; elsewhere over keys gathered from each
sequence's blocks, padded to the longest context.

Decode (`decode_attention`, traced into the compiled decode step): every row is one sequence's one new token. The
step's inputs come as one int64 tensor per step (see `DecodeBatch`), so the graph has no host synchronisation: the
KV write is an in-graph scatter into the layer's cache tensors. Then, by device:
- CUDA: the op `glowplug_triton::paged_decode_attention` (kernels/triton/attention.py), one opaque node in the
  graph, which reads K/V through the block table only up to each row's context (a row's cost follows its context,
  not the table's width, i.e. not max_model_len) and launches a grid that depends on shapes only, so CUDA graphs
  capture it. Where Triton cannot run (not installed, compute capability below 8.0) the tensor ops below run
  instead, and `triton_attention_unavailable_reason` says why (the native_kernels stage puts it on its span).
- CPU, `native`: glowplug's native op (kernels/native/attention.cpp).
- Otherwise the tensor ops: keys and values gathered by block table (the whole table, in fp32) and masked by
  context length; the softmax and weighted sum are reductions Inductor fuses with the gather.

Sliding windows (`window`, per layer: Gemma 3's local layers): a query at position p sees the keys at positions
p - window + 1 .. p, as transformers' sliding-window mask does (kv > q - window). The torch paths apply it as a mask
over the keys they already read; the Triton kernel loops over the window's blocks only, and the native op (the
compiled step on the CPU) skips the blocks before the window, so a windowed layer's decode reads at most `window`
positions (plus the rest of the window's first 16-token tile) whatever the context. The cache keeps every position
of every layer, so nothing about the blocks changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from glowplug.kernels.triton import attention as triton_attention

from .kv_cache import KVCache, LayerKV

# Columns of the decode step's packed input [B, DECODE_COLS + W]: token id, position, cache slot, context length
# (including the new token), then the block table padded to W blocks.
TOKEN, POSITION, SLOT, CONTEXT = 0, 1, 2, 3
DECODE_COLS = 4


def triton_attention_unavailable_reason(device: torch.device | str) -> str | None:
    """Why decode attention on `device` does not run the Triton paged kernel, or None when it does (a CUDA device
    of compute capability 8.0 or newer with triton importable). Off CUDA it never does: the CPU runs the native op
    or the tensor ops. When the answer is None the kernel's op is registered, so a compiled artifact that calls it
    finds it (the native_kernels stage asks before the decode step is traced or loaded)."""
    global _TRITON_READY
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"the Triton decode attention is for CUDA devices (device {dev.type})"
    reason = triton_attention.unavailable_reason(dev)
    if reason is None:
        triton_attention.register_op()
    if _TRITON_READY is None:
        # Wrapped here, on a CUDA device, not at import: assume_constant_result imports Dynamo (and through it
        # triton), which a CPU start and a warm start's replay must not pay for.
        _TRITON_READY = torch.compiler.assume_constant_result(_triton_ready)
    return reason


def _triton_ready(device: torch.device) -> bool:
    return triton_attention_unavailable_reason(device) is None


# `_triton_ready` as a constant for the trace (Dynamo runs it once, outside the graph), once a CUDA device was asked
# about; None before.
_TRITON_READY: Callable[[torch.device], bool] | None = None


def _use_triton(t: torch.Tensor) -> bool:
    """Whether the decode attention of `t`'s rows runs the Triton kernel (CUDA tensors where it can run)."""
    if not t.is_cuda:
        return False
    if _TRITON_READY is None:
        if torch.compiler.is_compiling():
            return False  # never asked before the trace (the native_kernels stage asks): the tensor ops
        triton_attention_unavailable_reason(t.device)
    return _TRITON_READY is not None and _TRITON_READY(t.device)


@dataclass
class AttentionMetadata:
    """Eager-path metadata for one engine step (tensors only; built once per step, shared by every layer)."""

    # [P, 3] int64 rows of (first row in the batch, number of new tokens, context length after this step)
    prefill_info: torch.Tensor
    # [P, W] int64 block tables of the prefill sequences (padded); [P, 0] when there is no cache
    prefill_block_tables: torch.Tensor
    kv_cache: KVCache | None = None
    slot_mapping: torch.Tensor | None = None  # [T] int64: cache slot for each new token
    decode_block_tables: torch.Tensor | None = None  # [B, W] int64, padded with the scratch block
    decode_ctx_lens: torch.Tensor | None = None  # [B] int64
    # Derived once per step on first use and shared by every layer.
    prefill_rows: list[list[int]] | None = None
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, W * block_size] bool
    # The same for each sliding window in use (window -> mask), also built once per step.
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def causal(cls, lengths: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Cache-less prefill of independent sequences (reference checks, perplexity, profiling runs)."""
        rows, start = [], 0
        for n in lengths:
            rows.append((start, n, n))
            start += n
        return cls(
            prefill_info=torch.tensor(rows, dtype=torch.long, device=device).reshape(-1, 3),
            prefill_block_tables=torch.zeros((len(rows), 0), dtype=torch.long, device=device),
            prefill_rows=[list(r) for r in rows],
        )


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kw: Any) -> torch.Tensor:
    # q: [B, H, Tq, D], k/v: [B, Hkv, Tk, D]; GQA is handled inside SDPA without materialising repeated heads.
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1], **kw)


def _chunk_mask(q_len: int, ctx_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q_len, ctx_len] bool: the chunk's queries sit at the end of the context, so query i (at position
    ctx - q_len + i) sees keys up to its own position, and with a window only the last `window` of those."""
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    kj = torch.arange(ctx_len, device=device)[None, :]
    mask = kj <= qpos
    return mask if window is None else mask & (kj > qpos - window)


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    cache: LayerKV | None,
    block_size: int,
    scale: float,
    window: int | None,
) -> None:
    if meta.prefill_rows is None:
        meta.prefill_rows = meta.prefill_info.tolist()  # once per step, not per layer
    tables = meta.prefill_block_tables
    for i, (start, q_len, ctx_len) in enumerate(meta.prefill_rows):
        rows = slice(start, start + q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)
        # A window no shorter than the context hides nothing: leave it out (and keep SDPA's causal fast path).
        win = window if window is not None and window < ctx_len else None
        if ctx_len == q_len or cache is None:
            # Nothing cached before this chunk: the fresh keys are the whole context, plain causal attention.
            ks, vs = k[rows], v[rows]
            kt, vt = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
            if win is None:
                o = _sdpa(qs, kt, vt, scale, is_causal=True)
            else:
                o = _sdpa(qs, kt, vt, scale, attn_mask=_chunk_mask(q_len, q_len, win, q.device))
        else:
            nb = -(-ctx_len // block_size)
            kb, vb = cache.read(tables[i, :nb], q.dtype)
            ks, vs = kb.flatten(0, 1)[:ctx_len], vb.flatten(0, 1)[:ctx_len]
            mask = _chunk_mask(q_len, ctx_len, win, q.device)
            o = _sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), scale, attn_mask=mask)
        out[rows] = o.squeeze(0).transpose(0, 1)


def _decode_mask(meta: AttentionMetadata, width: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[B, 1, 1, width] bool: the keys each decoding row sees (its context, or the last `window` of it), built once
    per step for each window and shared by the layers."""
    ctx_lens = meta.decode_ctx_lens
    assert ctx_lens is not None
    if meta.decode_mask is None:
        meta.decode_mask = (torch.arange(width, device=device)[None, :] < ctx_lens[:, None])[:, None, None, :]
    if window is None:
        return meta.decode_mask
    mask = meta.decode_window_masks.get(window)
    if mask is None:
        # The new token sits at ctx_len - 1: it sees positions ctx_len - window .. ctx_len - 1.
        recent = torch.arange(width, device=device)[None, :] >= (ctx_lens - window)[:, None]
        mask = meta.decode_window_masks[window] = meta.decode_mask & recent[:, None, None, :]
    return mask


def _decode_eager(
    q: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    cache: LayerKV,
    block_size: int,
    scale: float,
    window: int | None,
) -> None:
    tables, ctx_lens = meta.decode_block_tables, meta.decode_ctx_lens
    assert tables is not None and ctx_lens is not None
    p = q.shape[0] - tables.shape[0]
    if _use_triton(q):
        # Each row reads its own blocks up to its own context: nothing is gathered or padded to the longest.
        out[p:] = triton_attention.paged_decode_attention(
            q[p:], cache.k, cache.v, cache.k_scale, cache.v_scale, tables, ctx_lens, scale, window
        )
        return
    # fp32: the CPU's masked SDPA is ~6x slower in bf16 than in fp32 at these shapes, and the precision is free.
    qd = q[p:].unsqueeze(2).float()  # [B, H, 1, D]
    kd, vd = cache.read(tables, torch.float32)  # [B, W, bs, Hkv, D]
    mask = _decode_mask(meta, tables.shape[1] * block_size, window, q.device)
    o = _sdpa(qd, kd.flatten(1, 2).transpose(1, 2), vd.flatten(1, 2).transpose(1, 2), scale, attn_mask=mask)
    out[p:] = o.squeeze(2).to(out.dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Eager attention for a mixed step. q: [T, H, D], k/v: [T, Hkv, D] for the new tokens. Returns [T, H, D].
    `window`: this layer's sliding window (None: full causal attention)."""
    cache = meta.kv_cache
    lk = cache[layer] if cache is not None else None
    if lk is not None and meta.slot_mapping is not None:
        lk.store(k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    bs = cache.block_size if cache is not None else 1
    _prefill(q, k, v, out, meta, lk, bs, scale, window)
    if meta.decode_ctx_lens is not None and meta.decode_ctx_lens.numel():
        assert lk is not None
        _decode_eager(q, out, meta, lk, bs, scale, window)
    return out


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKV,
    packed: torch.Tensor,
    scale: float,
    native: bool = False,
    window: int | None = None,
) -> torch.Tensor:
    """One decode step for B sequences, traceable with no host synchronisation.

    q [B, H, D], k/v [B, Hkv, D] are the new tokens; `packed` is the step's [B, DECODE_COLS + W] input. The new k/v
    are written first, so each row attends to its own key too. Returns [B, H, D] in q's dtype.

    `native` (set by the native_kernels stage for the compiled step on the CPU) reads the cache with glowplug's
    native op (kernels/native/attention.cpp) instead of the tensor ops below, which are its reference: at batch 1 the
    Inductor kernel those ops compile to spent its time in fork/join barriers (reports/decode-quantized.md measures
    the step with it).

    On CUDA, where Triton can run (`triton_attention_unavailable_reason`), the paged Triton kernel's op reads the
    cache through the block table instead, up to each row's context only.

    `window`: this layer's sliding window (None: the whole context): each row sees its last `window` positions. The
    native op takes it too (0 there means none) and does not read the blocks before it, nor does the Triton op."""
    slots = packed[:, SLOT]
    cache.store(k, v, slots)
    if not native and _use_triton(q):
        paged: torch.Tensor = torch.ops.glowplug_triton.paged_decode_attention(
            q, cache.k, cache.v, cache.k_scale, cache.v_scale, packed, scale, window
        )
        return paged
    if native:
        ops = torch.ops.glowplug_native
        win = window or 0
        if cache.k_scale is not None and cache.v_scale is not None:
            out: torch.Tensor = ops.decode_attention_int8(
                q.contiguous(), cache.k, cache.v, cache.k_scale, cache.v_scale, packed, scale, win
            )
        else:
            out = ops.decode_attention(q.contiguous(), cache.k, cache.v, packed, scale, win)
        return out
    lens = packed[:, CONTEXT]
    tables = packed[:, DECODE_COLS:]
    b, heads, d = q.shape
    kv_heads = k.shape[1]
    block = cache.k.shape[1]
    width = tables.shape[1] * block
    keys, values = cache.read(tables, torch.float32)  # [B, W, bs, Hkv, D], gathered by block table
    keys = keys.reshape(b, width, kv_heads, 1, d)
    values = values.reshape(b, width, kv_heads, 1, d)
    qg = q.float().reshape(b, 1, kv_heads, heads // kv_heads, d)
    scores = (qg * keys).sum(-1) * scale  # [B, T, Hkv, G]; a reduction Inductor fuses with the gather
    key_pos = torch.arange(width, device=q.device)[None, :]
    visible = key_pos < lens[:, None]
    if window is not None:
        visible = visible & (key_pos >= (lens - window)[:, None])
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    probs = scores.softmax(dim=1)
    out = (probs[..., None] * values).sum(1)  # [B, Hkv, G, D]
    return out.reshape(b, heads, d).to(q.dtype)
