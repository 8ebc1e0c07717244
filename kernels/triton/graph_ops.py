"""The Triton linear kernels as torch custom ops (namespace `glowplug_triton`), for the compiled decode step on GPUs.

The launchers of ops.py size their grid from `x.shape[0]` as a Python int, which a Dynamo trace with a symbolic batch
cannot give them: that is why a quantized layer's stock path (the dispatcher) does not trace. Wrapped in a custom op
the launch happens only when the graph runs, with a concrete batch, and the trace sees one opaque node per layer whose
output shape and dtype come from the fake kernel. The op picks GEMV or GEMM from the row count when it runs (the split
of the dispatcher's CUDA rules, ops.GEMV_MAX_M), so one graph, and every CUDA graph captured from it, serves all batch
sizes with the kernel that suits each.

Ops (registered by `register()` on first use, never at import; tensors as ops.prepare leaves them):
  wq_linear(x, qweight, scales, zeros?, n, k, group, bits, mid)  int8 / int4 / int2 weight-only, y [M, n]
  w8a8_linear(x, qweight, scales, inv_smooth?, n, k)             int8 weights x per-token int8 activations, y [M, n]
y has x's dtype for fp32/fp16/bf16 activations (ops.out_dtype). The oracle is kernels/reference.linear.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from . import ops

NAMESPACE = "glowplug_triton"
_WQ_SCHEMA = (
    "(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, int n, int k, int group, int bits, int mid) -> Tensor"
)
_W8A8_SCHEMA = "(Tensor x, Tensor qweight, Tensor scales, Tensor? inv_smooth, int n, int k) -> Tensor"


@dataclass(frozen=True)
class DecodeOp:
    """One layer's call of an op, less its tensors (the layer passes its own buffers, so that a traced graph takes
    them as inputs): which op, and its int arguments."""

    w8a8: bool
    ints: tuple[int, ...]
    nbytes: int  # the weight bytes one decode step reads through it


def decode_op(st: ops.TritonWeight | ops.TritonW8A8) -> tuple[DecodeOp, tuple[Tensor | None, ...]]:
    """The op call for a prepared weight, and the tensors it takes after x (in the op's argument order)."""
    tensors: tuple[Tensor | None, ...]
    ints: tuple[int, ...]
    if isinstance(st, ops.TritonW8A8):
        tensors, ints, w8a8 = (st.qweight, st.scales, st.inv_smooth), (st.n, st.k), True
    else:
        tensors, ints, w8a8 = (st.qweight, st.scales, st.zeros), (st.n, st.k, st.group, st.bits, st.mid), False
    nbytes = sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return DecodeOp(w8a8, ints, nbytes), tensors


def linear(x: Tensor, op: DecodeOp, tensors: tuple[Tensor | None, ...]) -> Tensor:
    """y = x @ W^T through the op (x [M, K]); call `register()` first (a QuantLinear does when it switches)."""
    ns = getattr(torch.ops, NAMESPACE)
    y: Tensor = (ns.w8a8_linear if op.w8a8 else ns.wq_linear)(x, *tensors, *op.ints)
    return y


def _empty(x: Tensor, n: int) -> Tensor:
    return x.new_empty((x.shape[0], n), dtype=ops.out_dtype(x.dtype))


def _wq_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, n: int, k: int, group: int, bits: int, mid: int
) -> Tensor:
    if x.shape[0] == 0:  # no grid to launch
        return _empty(x, n)
    st = ops.TritonWeight(qweight, scales, zeros, n, k, group, bits, mid)
    return ops.gemv(x, st) if x.shape[0] <= ops.GEMV_MAX_M else ops.gemm(x, st)


def _wq_fake(
    x: Tensor, qweight: Tensor, scales: Tensor, zeros: Tensor | None, n: int, k: int, group: int, bits: int, mid: int
) -> Tensor:
    return _empty(x, n)


def _w8a8_linear(x: Tensor, qweight: Tensor, scales: Tensor, inv_smooth: Tensor | None, n: int, k: int) -> Tensor:
    if x.shape[0] == 0:
        return _empty(x, n)
    st = ops.TritonW8A8(qweight, scales, inv_smooth, n, k)
    return ops.gemv(x, st) if x.shape[0] <= ops.GEMV_MAX_M else ops.gemm(x, st)


def _w8a8_fake(x: Tensor, qweight: Tensor, scales: Tensor, inv_smooth: Tensor | None, n: int, k: int) -> Tensor:
    return _empty(x, n)


@functools.cache
def register() -> None:
    """Define the ops and their fake kernels in this process (once; a warm start's stored graph names them, so the
    stage that switches the layers registers them before any graph is loaded)."""
    wq = torch.library.custom_op(f"{NAMESPACE}::wq_linear", _wq_linear, mutates_args=(), schema=_WQ_SCHEMA)
    wq.register_fake(_wq_fake)
    w8a8 = torch.library.custom_op(f"{NAMESPACE}::w8a8_linear", _w8a8_linear, mutates_args=(), schema=_W8A8_SCHEMA)
    w8a8.register_fake(_w8a8_fake)
