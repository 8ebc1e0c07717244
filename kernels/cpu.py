"""CPU kernel paths: each is a `prepare(weight) -> state` run once at load time plus a `run(x, state, ws)`.

Measured with bench.py on the 2-core AVX-512 dev box (weights streamed from DRAM; 4096x4096, µs), which shaped
the set:
- `torch._weight_int8pack_mm` (668 at M=1) and aten's int4 kernel (254) are bandwidth-bound at M=1, but their
  cost grows ~linearly in M (int4: 1735 at M=16, 6914 at 64, 27350 at 256), while dequantize + bf16 GEMM costs
  a fixed dequant (2 ms int8, 4 ms int4) plus a GEMM that barely grows (1427 at M=1, 10108 at M=256).
- Dequantizing into a *fresh* tensor costs ~10x more than the arithmetic (page faults on a new multi-MB buffer),
  so the dequant paths write into a reusable `Workspace`.
- `torch._int_mm` (w8a8) has a fast M=1 path (547) but costs 4x more from M=2 (2133 at M=4), so tiny batches
  can be run row by row.
- Group-wise int8 has no aten kernel. It runs through the int4 kernel as two nibble planes of the same matrix,
  about as fast as `_weight_int8pack_mm` at M=1 (502).

Activations are cast to bf16: fp32 activations make the aten int8/int4 kernels 10-75x slower.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from glowplug.base import torch_compat

from .formats import (
    Int2Weight,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    W8A8Weight,
    quantize_per_token,
)

ATEN_INT4_GROUPS: tuple[int, ...] = (32, 64, 128, 256)
_BF16 = torch.bfloat16


class Workspace:
    """Reusable scratch buffers, one growing buffer per (thread, device, dtype).

    Buffers are handed out as views and are only valid until the next call that asks for the same dtype on the
    same thread, which is how the dequant paths use them (dequantize, multiply, done). Keying by thread keeps
    two engine threads from clobbering each other's weights mid-GEMM. Keying by inference mode: a buffer made
    under `torch.inference_mode()` is an inference tensor, which torch refuses to update in place outside it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str, torch.dtype, bool], Tensor] = {}
        self._lock = threading.Lock()

    def get(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = 1
        for s in shape:
            numel *= s
        key = (threading.get_ident(), str(device), dtype, torch.is_inference_mode_enabled())
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.numel() < numel:
                buf = torch.empty(numel, dtype=dtype, device=device)
                self._buffers[key] = buf
        return buf[:numel].view(shape)

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _scratch(ws: Workspace | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    # Under torch.compile a mutated module-external buffer would be baked into the graph; fresh tensors let
    # Inductor fuse the dequant instead.
    if ws is None or torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype, device=device)
    return ws.get(shape, dtype, device)


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


# --------------------------------------------------------------------------------------- aten int4 kernel
@dataclass(frozen=True)
class AtenInt4State:
    """Operands of `_weight_int4pack_mm_for_cpu`. Rows are padded to a multiple of 16 (the kernel's block) with
    zero-scale rows; `halves` marks the int8-as-two-nibble-planes layout whose output is out[:, :n] + out[:, n:]."""

    packed: Tensor
    scale_zeros: Tensor
    group_size: int
    n: int
    halves: bool


def _pack_aten_int4(
    codes: Tensor, scales: Tensor, zeros: Tensor, group_size: int, n: int, halves: bool
) -> AtenInt4State:
    rows = codes.shape[0]
    pad = _round_up(rows, 16) - rows
    if pad:
        # Code 8 with scale 0 and zero 0 dequantizes to exactly 0, so padded rows contribute nothing.
        codes = torch.cat([codes, torch.full((pad, codes.shape[1]), 8, dtype=codes.dtype)])
        scales = torch.cat([scales, torch.zeros(pad, scales.shape[1])])
        zeros = torch.cat([zeros, torch.zeros(pad, zeros.shape[1])])
    packed = torch_compat.convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
    # aten wants [G, N, 2] (scale, zero) pairs in the activation dtype.
    sz = torch.stack([scales.t(), zeros.t()], dim=-1).to(_BF16).contiguous()
    return AtenInt4State(packed, sz, group_size, n, halves)


def supports_aten_int4(w: PackedWeight) -> bool:
    if w.qweight.device.type != "cpu":
        return False
    if isinstance(w, (Int4Weight, Int2Weight)):
        return w.group_size in ATEN_INT4_GROUPS
    if isinstance(w, Int8Weight):
        return _int8_plane_group(w) is not None
    return False


def _int8_plane_group(w: Int8Weight) -> int | None:
    k = w.shape[1]
    if w.group_size is not None:
        return w.group_size if w.group_size in ATEN_INT4_GROUPS else None
    return next((g for g in (256, 128, 64, 32) if k % g == 0), None)


def prepare_aten_int4(w: PackedWeight) -> AtenInt4State:
    n, k = w.shape
    if isinstance(w, Int4Weight):
        zeros = torch.zeros_like(w.scales) if w.zeros is None else w.zeros
        return _pack_aten_int4(w.codes(), w.scales.float(), zeros.float(), w.group_size, n, False)
    if isinstance(w, Int2Weight):
        # (q2 + 6) - 8 == q2 - 2: the int2 codes become int4 codes with the very same scale and zero.
        return _pack_aten_int4(w.codes() + 6, w.scales.float(), w.zeros.float(), w.group_size, n, False)
    if isinstance(w, Int8Weight):
        gs = _int8_plane_group(w)
        if gs is None:
            raise ValueError("int8 weight has no aten-compatible group size")
        # q + 128 = 16 * hi + lo with hi, lo in [0, 15]  =>  s*q = 16s*(hi - 8) + [s*(lo - 8) + 8s].
        u = w.qweight.to(torch.int32) + 128
        hi, lo = u >> 4, u & 15
        s = w.scales.float().repeat_interleave(k // gs // w.scales.shape[1], dim=1)
        codes = torch.cat([hi, lo])
        scales = torch.cat([16 * s, s])
        zeros = torch.cat([torch.zeros_like(s), 8 * s])
        return _pack_aten_int4(codes, scales, zeros, gs, n, True)
    raise TypeError(f"aten int4 path does not take {type(w).__name__}")


def run_aten_int4(x: Tensor, st: AtenInt4State, ws: Workspace | None = None) -> Tensor:
    # The aten kernel assumes a dense row-major x; a bf16 view of a transposed tensor would be misread.
    out: Tensor = torch_compat.weight_int4pack_mm_for_cpu(
        x.to(_BF16).contiguous(), st.packed, st.group_size, st.scale_zeros
    )
    if st.halves:
        return out[:, : st.n] + out[:, st.n : 2 * st.n]
    return out[:, : st.n]


# ------------------------------------------------------------------------------- torch._weight_int8pack_mm
@dataclass(frozen=True)
class Int8PackState:
    qweight: Tensor
    scales: Tensor
    k_pad: int


def supports_int8pack(w: PackedWeight) -> bool:
    return isinstance(w, Int8Weight) and w.group_size is None and w.qweight.device.type == "cpu"


def prepare_int8pack(w: PackedWeight) -> Int8PackState:
    assert isinstance(w, Int8Weight)
    q = w.qweight
    # The kernel silently returns garbage (or crashes) unless K % 16 == 0: pad K with zero weights, and pad x.
    k_pad = _round_up(q.shape[1], 16) - q.shape[1]
    if k_pad:
        q = F.pad(q, (0, k_pad))
    return Int8PackState(q.contiguous(), w.scales.reshape(-1).to(_BF16).contiguous(), k_pad)


def run_int8pack(x: Tensor, st: Int8PackState, ws: Workspace | None = None) -> Tensor:
    xb = x.to(_BF16)
    if st.k_pad:
        xb = F.pad(xb, (0, st.k_pad))
    return torch_compat.weight_int8pack_mm(xb.contiguous(), st.qweight, st.scales)


# ------------------------------------------------------------------------------------ dequant + bf16 GEMM
@dataclass(frozen=True)
class DequantState:
    """What the dequant path needs: canonical codes, their midpoint, bf16 scales [N, G, 1] (None when they are
    applied to the output instead), fp32 zeros [N, G] or None, and per-channel output scales [1, N] or None."""

    weight: PackedWeight
    mid: int
    scales: Tensor | None
    zeros: Tensor | None
    post_scale: Tensor | None


def prepare_dequant(w: PackedWeight) -> DequantState:
    if isinstance(w, Int8Weight):
        if w.group_size is None:
            # Per-channel scales commute with the GEMM: scale the [M, N] output instead of the [N, K] weight.
            return DequantState(w, 0, None, None, w.scales.reshape(1, -1).to(_BF16))
        return DequantState(w, 0, w.scales[..., None].to(_BF16), None, None)
    if isinstance(w, (Int4Weight, Int2Weight)):
        mid = 8 if isinstance(w, Int4Weight) else 2
        zeros = None if w.zeros is None else w.zeros.float().contiguous()
        return DequantState(w, mid, w.scales[..., None].to(_BF16), zeros, None)
    raise TypeError(f"dequant path does not take {type(w).__name__}")


def dequantize_bf16(st: DequantState, ws: Workspace | None = None) -> Tensor:
    """The bf16 [N, K] matrix (q - mid) * scale, built in workspace memory. Zeros are not added here: they are
    applied to the output by `run_dequant` (x's group sums times zeros), which saves a pass over the weight."""
    w = st.weight
    n, k = w.shape
    dev = w.qweight.device
    out = _scratch(ws, (n, k), _BF16, dev)
    if isinstance(w, Int8Weight):
        out.copy_(w.qweight)
    else:
        assert isinstance(w, (Int4Weight, Int2Weight)), type(w).__name__
        bits = 4 if isinstance(w, Int4Weight) else 2
        per = 8 // bits
        gs = w.group_size
        mask = (1 << bits) - 1
        # Shift/mask into contiguous planes, centre them on int8 (1 byte/element, cheaper than on bf16), then
        # convert-copy each plane into its strided slots of the bf16 weight. Bitwise ops with a strided `out=`
        # run ~300x slower than contiguous ones; strided copies do not.
        planes = _scratch(ws, (per, n, k // per), torch.uint8, dev)
        for i in range(per):
            if i == 0:
                torch.bitwise_and(w.qweight, mask, out=planes[i])
            else:
                torch.bitwise_right_shift(w.qweight, bits * i, out=planes[i])
                if i < per - 1:
                    planes[i].bitwise_and_(mask)
        centred = planes.view(torch.int8).sub_(st.mid)
        slots = out.view(n, k // gs, per, gs // per)
        for i in range(per):
            slots[:, :, i, :].copy_(centred[i].view(n, k // gs, gs // per))
    if st.scales is not None:
        out.view(n, st.scales.shape[1], -1).mul_(st.scales)
    return out


def run_dequant(x: Tensor, st: DequantState, ws: Workspace | None = None) -> Tensor:
    xb = x.to(_BF16)
    y = F.linear(xb, dequantize_bf16(st, ws))
    if st.post_scale is not None:
        y.mul_(st.post_scale)
    if st.zeros is not None:
        # sum_k x[m,k] * zero[n, g(k)] = (group sums of x) @ zeros^T: an [M, G] x [G, N] product, in fp32 so the
        # two partial sums are added without an extra bf16 rounding.
        g = st.zeros.shape[1]
        xsum = xb.float().view(xb.shape[0], g, -1).sum(-1)
        return torch.addmm(y.float(), xsum, st.zeros.t())
    return y


# ------------------------------------------------------------------------------------- w8a8 via _int_mm
@dataclass(frozen=True)
class W8A8State:
    qweight_t: Tensor
    scales: Tensor
    inv_smooth: Tensor | None


def supports_int_mm(w: PackedWeight) -> bool:
    return isinstance(w, W8A8Weight) and w.qweight.device.type == "cpu"


def prepare_int_mm(w: PackedWeight) -> W8A8State:
    assert isinstance(w, W8A8Weight)
    inv = None
    if w.smooth is not None and not bool(torch.all(w.smooth == 1)):
        inv = (1.0 / w.smooth.float()).contiguous()
    # A transposed view, not a [K, N] copy: measured 3.5x faster at M=1 in _int_mm.
    return W8A8State(w.qweight.t(), w.scales.float().reshape(1, -1), inv)


def run_int_mm(x: Tensor, st: W8A8State, ws: Workspace | None = None) -> Tensor:
    xf = x.float()
    if st.inv_smooth is not None:
        xf = xf * st.inv_smooth
    xq, xs = quantize_per_token(xf)
    y = torch_compat.int_mm(xq, st.qweight_t).float()
    return y.mul_(xs).mul_(st.scales)


def run_int_mm_rows(x: Tensor, st: W8A8State, ws: Workspace | None = None) -> Tensor:
    """One _int_mm per token: M=1 takes a GEMV fast path that M>=2 misses (2 rows, 4096^2: 0.67 ms vs 1.4 ms)."""
    if x.shape[0] == 1:
        return run_int_mm(x, st)
    return torch.cat([run_int_mm(x[i : i + 1], st) for i in range(x.shape[0])])


# -------------------------------------------------------------------------------------- bf16 baseline
def run_bf16_linear(x: Tensor, weight_bf16: Tensor, ws: Workspace | None = None) -> Tensor:
    """The unquantized baseline the benchmarks compare against (not a dispatch target)."""
    return F.linear(x.to(_BF16), weight_bf16)
