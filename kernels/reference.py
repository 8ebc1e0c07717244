"""Pure-torch oracles: dequantize to fp32 and multiply. Every fast kernel is tested against these.

They are written for clarity, not speed, and follow the conventions documented in formats.py literally, so a
bug in a packing helper or a fast path shows up as a mismatch here rather than being shared by both sides.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .formats import (
    Int2Weight,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    W8A8Weight,
    dequantize_kv,
    quantize_per_token,
)


def _expand_groups(per_group: Tensor, k: int) -> Tensor:
    """[N, G] -> [N, K] by repeating each group's value over its columns."""
    return per_group.float().repeat_interleave(k // per_group.shape[1], dim=1)


def dequantize(w: PackedWeight) -> Tensor:
    """The fp32 [N, K] matrix a packed weight stands for (for w8a8: W * smooth, i.e. before un-smoothing)."""
    k = w.shape[1]
    if isinstance(w, Int8Weight):
        return w.qweight.float() * _expand_groups(w.scales, k)
    if isinstance(w, W8A8Weight):
        return w.qweight.float() * w.scales.float()[:, None]
    if isinstance(w, Int4Weight):
        codes = w.codes().float() - 8.0
        zeros = 0.0 if w.zeros is None else _expand_groups(w.zeros, k)
        return codes * _expand_groups(w.scales, k) + zeros
    if isinstance(w, Int2Weight):
        codes = w.codes().float() - 2.0
        return codes * _expand_groups(w.scales, k) + _expand_groups(w.zeros, k)
    raise TypeError(f"unknown packed weight type {type(w).__name__}")


def linear(x: Tensor, w: PackedWeight, bias: Tensor | None = None) -> Tensor:
    """y = x @ W^T (+ bias) in fp32 for x [..., K]; returns fp32 [..., N].

    For w8a8 the oracle reproduces the integer pipeline exactly (smooth, per-token int8 activations, integer
    dot products in float64, which is exact for |sum| < 2**53) so fast kernels can be held to a tight tolerance."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    x2 = x.reshape(-1, k).float()
    if isinstance(w, W8A8Weight):
        if w.smooth is not None:
            x2 = x2 / w.smooth.float()[None, :]
        xq, xs = quantize_per_token(x2)
        acc = xq.double() @ w.qweight.double().t()
        y = (acc * xs.double() * w.scales.double()[None, :]).float()
    else:
        y = x2 @ dequantize(w).t()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], n)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True) -> Tensor:
    """Plain fp32 attention for one sequence: q [Tq, Hq, D], k/v [Tk, Hkv, D] (GQA: Hq % Hkv == 0).

    With causal=True the last Tq queries attend to the Tk keys as if they were positions Tk-Tq .. Tk-1, which
    covers both prefill (Tq == Tk) and decode against a cache (Tq < Tk)."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} not a multiple of kv heads {hkv}")
    rep = hq // hkv
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) / math.sqrt(d)
    if causal:
        qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
        kpos = torch.arange(tk, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf)


def attention_int8_kv(
    q: Tensor, k_q: Tensor, k_scale: Tensor, v_q: Tensor, v_scale: Tensor, *, causal: bool = True
) -> Tensor:
    """Attention over an int8 KV cache (quantize_kv layout): dequantize K/V, then `attention`."""
    return attention(q, dequantize_kv(k_q, k_scale), dequantize_kv(v_q, v_scale), causal=causal)


def paged_decode_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
    packed: Tensor,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """fp32 oracle of the paged decode attention ops (kernels/triton/attention.py, and the native CPU ops of
    kernels/native/attention.cpp), from the same operands: q [B, H, D] one token per row; caches [blocks, block_size,
    Hkv, D] (int8 with fp32 scales [blocks, block_size, Hkv]); `packed` the decode step's [B, 4 + W] int64 input
    (context length in column 3, block table from column 4).
    Row by row, as written, reading only what the row attends to: its context L (capped at its table's capacity), of
    which the last `window` positions (None, or 0 and less: all), each from block table[pos // block_size] at
    pos % block_size; K/V repeated over each KV head's query heads, softmax in fp32. A block id outside the cache
    reads as zero keys and values (the native ops' rule for a block the engine never sends; the engine sends none
    within a context). Returns fp32 [B, H, D] (zeros for a row that sees no token)."""
    from .triton.attention import PACKED_CONTEXT, PACKED_TABLE

    b, heads, d = q.shape
    blocks, block_size, kv_heads = k_cache.shape[:3]
    out = torch.zeros(b, heads, d, dtype=torch.float32, device=q.device)
    for i in range(b):
        ctx = min(max(int(packed[i, PACKED_CONTEXT]), 0), (packed.shape[1] - PACKED_TABLE) * block_size)
        lo = ctx - window if window is not None and 0 < window < ctx else 0
        if ctx <= lo:
            continue
        pos = torch.arange(lo, ctx, device=q.device)
        blk = packed[i, PACKED_TABLE + pos // block_size]
        ok = (blk >= 0) & (blk < blocks)
        cells = (blk[ok], pos[ok] % block_size)
        k = torch.zeros(len(pos), kv_heads, d, device=q.device)
        v = torch.zeros_like(k)
        if k_scale is not None and v_scale is not None:
            k[ok], v[ok] = dequantize_kv(k_cache[cells], k_scale[cells]), dequantize_kv(v_cache[cells], v_scale[cells])
        else:
            k[ok], v[ok] = k_cache[cells].float(), v_cache[cells].float()
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # [T, H, D]
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,thd->ht", q[i].float(), k) * scale).softmax(-1)
        out[i] = torch.einsum("ht,thd->hd", probs, v)
    return out


def _unblock(t: Tensor, n: int) -> Tensor:
    """[NB, 16, ...] -> [n, ...] (drops the padding rows)."""
    return t.reshape(-1, *t.shape[2:])[:n]


def dequantize_blocked(wp: Tensor, n: int, k: int, bits: int, group_size: int) -> Tensor:
    """The fp32 [N, K] matrix in kernels.native.pack_blocked's layout (see blocked.cpp), decoded step by step from
    the layout's definition: bits 16 = dense bf16; 4/2: plane p of chunk word 2j + e is row j's code at
    k0 + 2p + e, then per-group fp16 scales and mins (w = q * scale + min); 8: dword j of a chunk is row j's bytes
    (offset by 128) at k0..k0 + 3, then per-group fp32 scales."""
    nb = wp.shape[0]
    if bits == 16:
        w = wp.view(torch.bfloat16).reshape(nb, k // 2, 16, 2).permute(0, 2, 1, 3).reshape(nb, 16, k)
        return _unblock(w.float(), n)
    raw = wp.reshape(nb, -1)
    g = k // group_size
    if bits in (4, 2):
        planes = 16 // bits
        code_bytes = k * bits * 2
        words = raw[:, :code_bytes].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        words = words.reshape(nb, k // (2 * planes), 16, 2)  # [NB, chunk, row j, e]
        codes = torch.stack([(words >> (bits * p)) & ((1 << bits) - 1) for p in range(planes)], dim=3)
        codes = codes.permute(0, 2, 1, 3, 4).reshape(nb, 16, k).float()  # k = chunk * 2 * planes + 2p + e
        scales = raw[:, code_bytes : code_bytes + 32 * g].contiguous().view(torch.float16).reshape(nb, g, 16)
        mins = raw[:, code_bytes + 32 * g :].contiguous().view(torch.float16).reshape(nb, g, 16)
        s = scales.float().permute(0, 2, 1).repeat_interleave(group_size, dim=2)
        m = mins.float().permute(0, 2, 1).repeat_interleave(group_size, dim=2)
        return _unblock(codes * s + m, n)
    if bits == 8:
        code_bytes = k * 16
        u = raw[:, :code_bytes].reshape(nb, k // 4, 16, 4)  # [NB, chunk, row j, i]: k = 4 * chunk + i
        q = u.permute(0, 2, 1, 3).reshape(nb, 16, k).float() - 128
        scales = raw[:, code_bytes:].contiguous().view(torch.float32).reshape(nb, g, 16)
        return _unblock(q * scales.permute(0, 2, 1).repeat_interleave(group_size, dim=2), n)
    raise ValueError(f"no blocked layout with {bits} bits")


def quantize_x16(x: Tensor, block: int = 32) -> Tensor:
    """The activations the native int8 kernel multiplies, as fp32: per row and per `block` inputs, x rounded to
    multiples of s = max|x| / 32639 (half to even), the 16-bit fixed point the kernel splits into two signed bytes."""
    xf = x.float().reshape(x.shape[0], -1, block)
    s = xf.abs().amax(-1, keepdim=True) / 32639
    q = torch.where(s > 0, torch.round(xf / torch.where(s > 0, s, 1)), 0)
    return (q * s).reshape(x.shape[0], -1)


def quantize_x8(x: Tensor, group_size: int) -> Tensor:
    """The activations the native int4 kernel multiplies from the AVX2 level up (below the AMX batches), as fp32:
    per row and per weight group, x rounded to multiples of s = max|x| / 127 (half to even), the int8 codes it meets
    the weight codes with."""
    xf = x.float().reshape(x.shape[0], -1, group_size)
    amax = xf.abs().amax(-1, keepdim=True)
    # the kernel's arithmetic: q = round(x * (127 / amax)), dequantized as q * (amax / 127)
    q = torch.round(xf * torch.where(amax > 0, 127 / amax, 0))
    return (q * (amax / 127)).reshape(x.shape[0], -1)


def native_linear(
    x: Tensor,
    kind: str,
    tensors: tuple[Tensor, ...],
    n: int,
    k: int,
    bits: int = 0,
    group_size: int = 0,
    int8_activations: bool = False,
) -> Tensor:
    """fp32 oracle for each native op (kernels/native.py), from the same operands the op receives: kind "dense"
    (row-major weight), "dense_blocked", "intn"/"int8" (blocked layouts) or "w8a8". int8_activations: the int4
    kernel's activations at the levels that take them to int8 (`quantize_x8`)."""
    xf = x.float()
    if kind == "dense":
        return xf @ tensors[0].float().t()
    if kind == "dense_blocked":
        return xf @ dequantize_blocked(tensors[0], n, k, 16, 0).t()
    if kind == "int8":
        return quantize_x16(x) @ dequantize_blocked(tensors[0], n, k, 8, group_size).t()
    if kind == "intn":
        xa = quantize_x8(x, group_size) if int8_activations and bits == 4 else xf
        return xa @ dequantize_blocked(tensors[0], n, k, bits, group_size).t()
    if kind == "w8a8":
        q, wscale, _, inv = tensors
        smooth = None if inv.numel() == 0 else 1.0 / inv
        return linear(xf, W8A8Weight(q, wscale, smooth))
    raise ValueError(f"unknown native kernel kind {kind!r}")


# ------------------------------------------------------------------------------------- GGUF blocks as stored
# The super-block types, whose activations are quantized per 256 inputs (the others per 32).
GGUF_KQUANTS = frozenset({12, 13, 14})


def quantize_act(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """gguf_linear's activations: each row's inputs in blocks of `block` (32, or 256 for the K-quants) taken to int8
    with scale d = amax / 127, codes round(x * (127 / amax)) half to even, all in fp32. Returns (q int8 [M, K],
    d fp32 [M, K / block])."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(-1)
    inv = torch.tensor(127.0, dtype=torch.float32) / torch.where(amax > 0, amax, torch.ones_like(amax))
    q = torch.round(xb * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    q = torch.where(amax[..., None] > 0, q, torch.zeros_like(q))
    return q.reshape(m, k), amax / 127.0


def gguf_dequantize(raw: Tensor, ggml_type: int, k: int) -> Tensor:
    """fp32 [rows, K] of stored GGUF rows (uint8 [rows, row bytes]), de-quantized by the gguf package."""
    if ggml_type == 0:
        return raw.contiguous().view(torch.float32).reshape(-1, k).clone()
    if ggml_type in (1, 30):
        return raw.contiguous().view(torch.float16 if ggml_type == 1 else torch.bfloat16).reshape(-1, k).float()
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequant

    return torch.from_numpy(gguf_dequant(raw.contiguous().numpy(), GGMLQuantizationType(ggml_type))).reshape(-1, k)


def gguf_linear(x: Tensor, segments: list[tuple[Tensor, int, Tensor | None]]) -> Tensor:
    """The oracle of glowplug_native.gguf_linear, in float64: x [M, K] taken to the kernel's int8 activations (float
    parts take x in fp32), times each segment's de-quantized rows; a segment's `perm` puts stored row r in column
    perm[r] of its block. Returns float64 [M, sum of rows]."""
    m, k = x.shape
    outs = []
    for raw, ggml_type, perm in segments:
        w = gguf_dequantize(raw, ggml_type, k).double()
        if ggml_type in (0, 1, 30):  # F32, F16, BF16
            xs = x.float().double()
        else:
            block = 256 if ggml_type in GGUF_KQUANTS else 32
            q, d = quantize_act(x, block)
            xs = (q.double().reshape(m, k // block, block) * d.double()[..., None]).reshape(m, k)
        y = xs @ w.t()
        if perm is not None:
            y = torch.empty_like(y).index_copy_(1, perm.long(), y)
        outs.append(y)
    return torch.cat(outs, dim=1)


def gguf_rows(raw: Tensor, ggml_type: int, k: int, ids: Tensor) -> Tensor:
    """The oracle of glowplug_native.gguf_rows: the chosen rows de-quantized to fp32."""
    return gguf_dequantize(raw[ids], ggml_type, k)
