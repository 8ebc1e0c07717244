"""The @triton.jit kernels of paged decode attention. Importing this module imports triton; only attention.py does,
and only on first launch.

One decode token per row attends to its context through the row's block table (token t of the row sits at
block table[t // BLOCK_SIZE], offset t % BLOCK_SIZE), in a flash-decoding split:

- `paged_decode_kernel`, grid (B, Hkv, P): program (b, h, p) takes KV head h of row b and the tokens
  [p * PART, (p + 1) * PART) of its context, intersected with the tokens the row sees: [lo, L), L the context length
  and lo = max(L - window, 0) with a sliding window, else 0. Its loop runs over exactly that range, BLOCK_N tokens
  at a time, so a partition past the context (or before a window) loads the context length and its query heads
  (L2 hits after the first program of the row) and no K/V, and a windowed layer reads only its window's K/V. One
  program serves all G = H / Hkv query heads of its KV head (padded to G_PAD rows, at least 16 for tl.dot), so each
  K/V tile is read once. Softmax is online (running max and sum) in fp32. With one partition (SPLIT False) it normalises
  and writes the output; else it writes the partition's running max, sum and unnormalised accumulator.
- `paged_decode_combine_kernel`, grid (B, H): merges the partitions the row's range touched, recomputing which from
  L and the window (so partitions that did nothing are never read, and the scratch needs no initialisation).

P depends only on the table width (a shape), never on the lengths, so a CUDA graph captured at one context replays
at any other.

int8 caches: each (slot, head) has one fp32 scale. Keys: q . (k * s) = (q . k) * s, so the integer codes go into
the dot product as they are (exact in bf16/fp16: |k| <= 127) and the score column is scaled after. Values are
dequantized to fp32 first and then rounded to the dot's operand type, as a float cache's values are stored.
"""

# Kernel parameters are Triton DSL values (pointers, tl.constexpr), which Python type hints cannot express.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_ptr,
    ctx_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    scale,
    window,
    block_size,
    partition,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_tb,
    stride_cb,
    stride_ob,
    stride_oh,
    stride_mb,
    stride_mh,
    stride_ab,
    stride_ah,
    stride_ap,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INT8: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    part = tl.program_id(2).to(tl.int64)

    ctx = tl.load(ctx_ptr + b * stride_cb)  # int64
    lo = ctx * 0
    if window > 0:
        lo = tl.maximum(ctx - window, 0)
    start = tl.maximum(part * partition, lo)
    end = tl.minimum((part + 1) * partition, ctx)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    d_ok = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    # exp2 instead of exp: fold log2(e) into the score scale once.
    qk_scale = scale * 1.4426950408889634

    m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), dtype=tl.float32)
    table_row = table_ptr + b * stride_tb
    # Empty when this partition lies outside [lo, ctx): the program then reads nothing more.
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        blk = tl.load(table_row + offs_n // block_size, mask=n_ok, other=0)
        within = offs_n % block_size
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k_off = blk * stride_kb + within * stride_ks + kvh * stride_kh
        v_off = blk * stride_vb + within * stride_vs + kvh * stride_vh
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0)
        if INT8:
            s_off = blk * stride_sb + within * stride_ss + kvh * stride_sh
            k_sc = tl.load(ks_ptr + s_off, mask=n_ok, other=0.0)
            v_sc = tl.load(vs_ptr + s_off, mask=n_ok, other=0.0)
            v = v.to(tl.float32) * v_sc[:, None]
        k = k.to(q.dtype)
        if DOT_F32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if INT8:
            s = s * k_sc[None, :]
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))  # [G_PAD, BLOCK_N], log2 units

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds at least one visible token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    row_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # Partitions outside [lo, ctx) store nothing: the combine recomputes which ones ran.
        if start < end:
            ml_off = b * stride_mb + heads * stride_mh + part
            tl.store(m_ptr + ml_off, m_i, mask=g_ok)
            tl.store(l_ptr + ml_off, l_i, mask=g_ok)
            a_off = b * stride_ab + heads[:, None] * stride_ah + part * stride_ap + offs_d[None, :]
            tl.store(acc_ptr + a_off, acc, mask=row_mask)
    else:
        # A row that sees nothing (context 0) writes zeros rather than 0 / 0.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask,
        )


@triton.jit
def paged_decode_combine_kernel(
    ctx_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    window,
    partition,
    stride_cb,
    stride_mb,
    stride_mh,
    stride_ab,
    stride_ah,
    stride_ap,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b * stride_cb)
    lo = ctx * 0
    if window > 0:
        lo = tl.maximum(ctx - window, 0)
    # The partitions the kernel above ran: those overlapping [lo, ctx).
    first = lo // partition
    last = (ctx + partition - 1) // partition

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m = tl.full((), float("-inf"), dtype=tl.float32)
    total = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    ml_row = b * stride_mb + h * stride_mh
    a_row = b * stride_ab + h * stride_ah
    for p in range(first, last):
        m_p = tl.load(m_ptr + ml_row + p)
        l_p = tl.load(l_ptr + ml_row + p)
        a_p = tl.load(acc_ptr + a_row + p * stride_ap + offs_d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m, m_p)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_p - m_new)
        acc = acc * alpha + a_p * beta
        total = total * alpha + l_p * beta
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
