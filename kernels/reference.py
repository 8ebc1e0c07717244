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


def dequantize_intn_rows(rows: Tensor, n: int, k: int, bits: int, group_size: int) -> Tensor:
    """The fp32 [N, K] matrix stored in the native kernels' fused int4/int2 rows (kernels.native.pack_intn_rows):
    codes planar within each group, then G fp16 scales and G fp16 mins, w = q * scale + min."""
    per = 8 // bits
    g = k // group_size
    code_bytes = k * bits // 8
    body = rows[:n]
    codes = body[:, :code_bytes].reshape(n, g, 1, group_size // per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=rows.device).view(1, 1, per, 1)
    q = ((codes >> shifts) & ((1 << bits) - 1)).reshape(n, k).float()
    scales = body[:, code_bytes : code_bytes + 2 * g].contiguous().view(torch.float16).float()
    mins = body[:, code_bytes + 2 * g : code_bytes + 4 * g].contiguous().view(torch.float16).float()
    return q * scales.repeat_interleave(group_size, dim=1) + mins.repeat_interleave(group_size, dim=1)


def native_linear(x: Tensor, kind: str, tensors: tuple[Tensor, ...], n: int, k: int, bits: int = 0,
                  group_size: int = 0) -> Tensor:
    """fp32 oracle for each native op (kernels/native.py), from the same operands the op receives."""
    xf = x.float()
    if kind == "dense":
        return xf @ tensors[0].float().t()
    if kind == "int8":
        q, scales = tensors
        gs = k // scales.shape[1]
        return linear(xf, Int8Weight(q, scales, None if scales.shape[1] == 1 else gs))
    if kind == "intn":
        return xf @ dequantize_intn_rows(tensors[0], n, k, bits, group_size).t()
    if kind == "w8a8":
        q, wscale, _, inv = tensors
        smooth = None if inv.numel() == 0 else 1.0 / inv
        return linear(xf, W8A8Weight(q, wscale, smooth))
    raise ValueError(f"unknown native kernel kind {kind!r}")
