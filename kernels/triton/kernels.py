"""The @triton.jit kernels. Importing this module imports triton; only `ops.py` does, and only on first launch.

One weight-only kernel body serves int8/int4/int2 through constexpr BITS, reading the canonical layout of
formats.py directly (planar sub-byte packing within a group), so no GPU-specific repacking is needed:
    code(n, k) = (byte[n, (k // GROUP) * SUB + (k % GROUP) % SUB] >> (BITS * ((k % GROUP) // SUB))) & MASK
    w(n, k)    = (code - MID) * scale[n, k // GROUP] + zero[n, k // GROUP]
with SUB = GROUP * BITS // 8. int8 is the BITS=8 case (signed codes, MID=0, GROUP=K when per-channel).

Matrix products use fp32 operands: the interpreter mis-computes bf16 `tl.dot`, and on a GPU the same code runs
as TF32 (DOT_PRECISION), keeping one numerically tested code path.
"""

# Kernel parameters are Triton DSL values (pointers, tl.constexpr), which Python type hints cannot express.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dequant_tile(
    w_ptr,
    s_ptr,
    z_ptr,
    offs_n,
    offs_k,
    N,
    K,
    stride_wn,
    n_groups,
    GROUP,
    BITS: tl.constexpr,
    MID: tl.constexpr,
    HAS_ZERO: tl.constexpr,
):
    """fp32 [BLOCK_N, BLOCK_K] tile of the dequantized weight (zeros outside N x K)."""
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    g = offs_k // GROUP
    if BITS == 8:
        codes = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0).to(tl.float32)
    else:
        sub = GROUP * BITS // 8
        in_group = offs_k % GROUP
        byte = g * sub + in_group % sub
        shift = (in_group // sub) * BITS
        raw = tl.load(w_ptr + offs_n[:, None] * stride_wn + byte[None, :], mask=mask, other=0).to(tl.int32)
        codes = ((raw >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    sz_off = offs_n[:, None] * n_groups + g[None, :]
    scale = tl.load(s_ptr + sz_off, mask=mask, other=0.0)
    w = (codes - MID) * scale
    if HAS_ZERO:
        w += tl.load(z_ptr + sz_off, mask=mask, other=0.0)
    return w


@triton.jit
def _tile_offsets(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows and columns of this program's [BLOCK_M, BLOCK_N] output tile (grid: M tiles, then N tiles)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n


@triton.jit
def _load_tile(ptr, offs_r, offs_c, R, C, stride_r):
    """The [rows, cols] tile of a row-major [R, C] matrix at `ptr` (zeros outside it)."""
    mask = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    return tl.load(ptr + offs_r[:, None] * stride_r + offs_c[None, :], mask=mask, other=0)


@triton.jit
def _store_tile(ptr, tile, offs_r, offs_c, R, C, stride_r):
    """Write `tile` at rows offs_r, columns offs_c of a row-major [R, C] matrix, clipped to it."""
    mask = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    tl.store(ptr + offs_r[:, None] * stride_r + offs_c[None, :], tile, mask=mask)


@triton.jit
def wq_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    n_groups,
    GROUP,
    BITS: tl.constexpr,
    MID: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y = x @ W^T with W dequantized tile by tile in registers. USE_DOT=False is the small-M path: grid (N tiles,
    rows of x), one row per program, so weight bytes are read once per row with no tensor-core tile padding wasted
    on M=1 (BLOCK_M unused). USE_DOT=True is the larger-M path: grid (M tiles, N tiles), each [BLOCK_N, BLOCK_K]
    weight tile multiplied against BLOCK_M rows of x by tl.dot."""
    if USE_DOT:
        offs_m, offs_n = _tile_offsets(BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = _load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm)
            w = _dequant_tile(
                w_ptr, s_ptr, z_ptr, offs_n, offs_k, N, K, stride_wn, n_groups, GROUP, BITS, MID, HAS_ZERO
            )
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision=DOT_PRECISION)
        _store_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym)
    else:
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            w = _dequant_tile(
                w_ptr, s_ptr, z_ptr, offs_n, offs_k, N, K, stride_wn, n_groups, GROUP, BITS, MID, HAS_ZERO
            )
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(y_ptr + m * stride_ym + offs_n, acc, mask=offs_n < N)


@triton.jit
def w8a8_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """int8 x int8 -> int32, then y = acc * x_scale[m] * w_scale[n]. USE_DOT=False is the GEMV form (CUDA-core
    multiply-add; tl.dot needs M tiles of at least 16 rows, wasteful at M=1)."""
    offs_m, offs_n = _tile_offsets(BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = _load_tile(xq_ptr, offs_m, offs_k, M, K, stride_xm)
        w = _load_tile(w_ptr, offs_n, offs_k, N, K, stride_wn)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.int32)
        else:
            prod = x.to(tl.int32)[:, None, :] * w.to(tl.int32)[None, :, :]
            acc += tl.sum(prod, axis=2)
    xs = tl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)
    wsc = tl.load(ws_ptr + offs_n, mask=offs_n < N, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * wsc[None, :]
    _store_tile(y_ptr, y, offs_m, offs_n, M, N, stride_ym)
