"""Launchers for the Triton kernels: `prepare(weight) -> state` at load time, `gemv`/`gemm(x, state)` per call.

Kernels are imported on first launch (triton is optional). On CPU tensors these only work under
TRITON_INTERPRET=1 (tests); the dispatcher picks them for CUDA tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from glowplug.kernels.formats import (
    Int2Weight,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    W8A8Weight,
    quantize_per_token,
)

from . import available, interpreting

# Block shapes: GEMV streams wide K tiles per row; GEMM uses tensor-core friendly 32x64x64 tiles. Tests pass
# smaller ones so that tiny shapes still cover tails and several K iterations.
GEMV_BLOCKS = {"BLOCK_N": 64, "BLOCK_K": 128}
GEMM_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}
# Rows up to which GEMV beats GEMM: beyond a handful of rows the GEMV re-reads the weight once per row, while the
# GEMM's tl.dot tiles read it once per BLOCK_M rows. The dispatcher's CUDA rules and the decode op
# (graph_ops.py) both split here.
GEMV_MAX_M = 8
# tl.dot in TF32 and int8 needs Ampere (sm_80) or newer.
MIN_CAPABILITY = (8, 0)


def _kernels() -> ModuleType:
    if not available():
        raise RuntimeError("triton is not installed; `pip install triton` (GPU) or use the CPU paths")
    from . import kernels

    return kernels


@dataclass(frozen=True)
class TritonWeight:
    """The canonical tensors plus the constants the kernel needs: code width, midpoint, group length."""

    qweight: Tensor
    scales: Tensor
    zeros: Tensor | None
    n: int
    k: int
    group: int
    bits: int
    mid: int


@dataclass(frozen=True)
class TritonW8A8:
    qweight: Tensor
    scales: Tensor
    inv_smooth: Tensor | None
    n: int
    k: int


def supports(w: PackedWeight) -> bool:
    return unsupported_reason(w.qweight.device) is None


def unsupported_reason(device: torch.device | str) -> str | None:
    """Why these kernels cannot run on tensors of `device`, or None when they can (a start says this on its row
    when quantized layers fall back to the eager dispatcher)."""
    if not available():
        return "triton is not installed"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        # TF32 and int8 tl.dot need Ampere or newer; older GPUs take the dispatcher's reference fallback.
        cap = torch.cuda.get_device_capability(dev)
        if cap < MIN_CAPABILITY:
            return (
                f"compute capability {cap[0]}.{cap[1]} is below {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                f"(the kernels' TF32 and int8 tl.dot need Ampere or newer)"
            )
        return None
    if interpreting():
        return None
    return f"Triton kernels run on CUDA tensors (device {dev.type}; TRITON_INTERPRET=1 runs them on the CPU)"


def prepare(w: PackedWeight) -> TritonWeight | TritonW8A8:
    n, k = w.shape
    if isinstance(w, W8A8Weight):
        inv = None
        if w.smooth is not None and not bool(torch.all(w.smooth == 1)):
            inv = (1.0 / w.smooth.float()).contiguous()
        return TritonW8A8(w.qweight.contiguous(), w.scales.float().reshape(-1).contiguous(), inv, n, k)
    if isinstance(w, Int8Weight):
        group = k if w.group_size is None else w.group_size
        return TritonWeight(w.qweight.contiguous(), w.scales.float().contiguous(), None, n, k, group, 8, 0)
    if isinstance(w, Int4Weight):
        zeros = None if w.zeros is None else w.zeros.float().contiguous()
        return TritonWeight(w.qweight.contiguous(), w.scales.float().contiguous(), zeros, n, k, w.group_size, 4, 8)
    if isinstance(w, Int2Weight):
        return TritonWeight(
            w.qweight.contiguous(),
            w.scales.float().contiguous(),
            w.zeros.float().contiguous(),
            n,
            k,
            w.group_size,
            2,
            2,
        )
    raise TypeError(f"no Triton kernel for {type(w).__name__}")


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels write for activations of `dtype`: fp32 and half-precision activations keep theirs (the
    kernel stores with a cast), anything else gets fp32."""
    return dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


def _out(x: Tensor, n: int) -> Tensor:
    return torch.empty(x.shape[0], n, dtype=out_dtype(x.dtype), device=x.device)


def _wq_args(x: Tensor, st: TritonWeight, y: Tensor) -> tuple[object, ...]:
    zeros = st.zeros if st.zeros is not None else st.scales  # never read when HAS_ZERO is False
    return (
        x,
        st.qweight,
        st.scales,
        zeros,
        y,
        x.shape[0],
        st.n,
        st.k,
        x.stride(0),
        st.qweight.stride(0),
        y.stride(0),
        st.scales.shape[1],
        st.group,
    )


def _w8a8(x: Tensor, st: TritonW8A8, use_dot: bool, blocks: dict[str, int]) -> Tensor:
    k = _kernels()
    xf = x.float()
    if st.inv_smooth is not None:
        xf = xf * st.inv_smooth
    xq, xs = quantize_per_token(xf)
    y = _out(x, st.n)
    m = x.shape[0]
    grid = (_cdiv(m, blocks["BLOCK_M"]), _cdiv(st.n, blocks["BLOCK_N"]))
    k.w8a8_kernel[grid](
        xq,
        xs.reshape(-1).contiguous(),
        st.qweight,
        st.scales,
        y,
        m,
        st.n,
        st.k,
        xq.stride(0),
        st.qweight.stride(0),
        y.stride(0),
        USE_DOT=use_dot,
        **blocks,
    )
    return y


def _wq(x: Tensor, st: TritonWeight, use_dot: bool, blocks: dict[str, int]) -> Tensor:
    """The weight-only kernel on contiguous x: the GEMV form (grid: N tiles, rows) or the tl.dot one (grid: M tiles,
    N tiles)."""
    k = _kernels()
    y = _out(x, st.n)
    m = x.shape[0]
    if use_dot:
        grid = (_cdiv(m, blocks["BLOCK_M"]), _cdiv(st.n, blocks["BLOCK_N"]))
    else:
        grid = (_cdiv(st.n, blocks["BLOCK_N"]), m)
    # The interpreter computes tl.dot exactly in fp32 whatever is asked; on a GPU, fp32 operands go through TF32.
    precision = "ieee" if interpreting() else "tf32"
    k.wq_matmul_kernel[grid](
        *_wq_args(x, st, y),
        BITS=st.bits,
        MID=st.mid,
        HAS_ZERO=st.zeros is not None,
        USE_DOT=use_dot,
        DOT_PRECISION=precision,
        **blocks,
    )
    return y


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def gemv(x: Tensor, st: TritonWeight | TritonW8A8, blocks: dict[str, int] | None = None) -> Tensor:
    """y[M, N] = x[M, K] @ W^T for small M (one program per row and BLOCK_N outputs)."""
    x = x.contiguous()
    if isinstance(st, TritonW8A8):
        b = {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 64, **(blocks or {})}
        return _w8a8(x, st, False, b)
    return _wq(x, st, False, {"BLOCK_M": 1, **GEMV_BLOCKS, **(blocks or {})})


def gemm(x: Tensor, st: TritonWeight | TritonW8A8, blocks: dict[str, int] | None = None) -> Tensor:
    """y[M, N] = x[M, K] @ W^T with tl.dot tiles; the choice for M beyond a handful of rows."""
    x = x.contiguous()
    if isinstance(st, TritonW8A8):
        b = {**GEMM_BLOCKS, **(blocks or {})}
        return _w8a8(x, st, True, b)
    return _wq(x, st, True, {**GEMM_BLOCKS, **(blocks or {})})
