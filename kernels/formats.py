"""Weight/activation/KV quantization formats: layouts, bit packing and round-to-nearest quantizers.

Every format is a small frozen dataclass of plain tensors (the *canonical* layout). The canonical layout is what
goes into a quantized state dict: it is device-independent and documented here, so the CPU path, the Triton
kernels and the pure-torch reference all read the same bytes. Kernel-specific layouts (e.g. aten's opaque int4
tile layout) are derived from it at load time by `glowplug.kernels.cpu` and never stored.

Conventions (N = output features, K = input features, G = K // group_size groups per row):
- int8:  w = qweight * scales[n, g]          qweight int8 in [-127, 127], scales fp32 [N, G] (G = 1: per-channel)
- int4:  w = (q - 8) * scales[n, g] + zeros[n, g]   q uint4 in [0, 15]; symmetric => zeros is None (== 0)
- int2:  w = (q - 2) * scales[n, g] + zeros[n, g]   q uint2 in [0, 3]; always asymmetric (2 bits need it)
- w8a8:  W' = W * smooth[None, :] quantized per output channel; x' = x / smooth quantized per token at runtime.

The "(q - mid) * scale + zero" form for int4/int2 is the one aten's CPU int4 kernel evaluates, so int4 feeds
it without any arithmetic conversion and int2 feeds it after adding 6 to each code (see cpu.py).

Sub-byte packing is *planar within a group*: for bits b and p = 8 // b codes per byte, the group's codes are
split into p contiguous planes of group_size // p; byte j of the group holds plane i's j-th code at bit b*i.
Planar (not interleaved even/odd) packing makes CPU unpacking a few contiguous vector ops (interleaved writes
measured 25x slower in eager torch) and keeps a group's bytes contiguous for a Triton tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
# The config only offers 128 for int2; smaller groups exist for layers whose K is not a multiple of 128
# (see effective_group_size), e.g. every K=576 projection of the default model.
INT2_GROUP_SIZES: tuple[int, ...] = GROUP_SIZES
INT8_QMAX = 127
KV_QMAX = 127
# Scales are clamped away from zero so all-zero groups quantize to code 0 instead of dividing by zero; any value
# this small dequantizes to ~0 whatever code is chosen.
_MIN_SCALE = 1e-10


def _check_2d(w: Tensor) -> tuple[int, int]:
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if not (w.is_floating_point()):
        raise ValueError(f"expected a floating-point weight, got {w.dtype}")
    return int(w.shape[0]), int(w.shape[1])


def _check_group(k: int, group_size: int, allowed: tuple[int, ...], what: str) -> None:
    if group_size not in allowed:
        raise ValueError(f"{what}: group_size {group_size} not supported; use one of {list(allowed)}")
    if k % group_size:
        raise ValueError(f"{what}: in_features {k} is not a multiple of group_size {group_size}")


def effective_group_size(k: int, requested: int, allowed: tuple[int, ...] = GROUP_SIZES) -> int:
    """The largest allowed group size <= requested that divides K.

    Lets one configured group size (say 128) serve layers whose K it does not divide (K=576 gets 64) instead of
    refusing the model; it depends only on (K, requested), so quantization and module conversion agree."""
    fits = [g for g in allowed if g <= requested and k % g == 0]
    if not fits:
        raise ValueError(f"in_features {k} is not a multiple of any group size <= {requested} in {list(allowed)}")
    return max(fits)


# ----------------------------------------------------------------------------------------------- bit packing
def pack_bits(codes: Tensor, bits: int, group_size: int) -> Tensor:
    """Pack unsigned codes [N, K] (< 2**bits) into uint8 [N, K * bits // 8], planar within each group."""
    if bits not in (2, 4):
        raise ValueError(f"pack_bits supports 2 or 4 bits, got {bits}")
    n, k = codes.shape
    per_byte = 8 // bits
    if k % group_size or group_size % per_byte:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}, itself a multiple of {per_byte}")
    sub = group_size // per_byte
    planes = codes.to(torch.uint8).reshape(n, k // group_size, per_byte, sub)
    out = planes[:, :, 0, :].clone()
    for i in range(1, per_byte):
        out |= planes[:, :, i, :] << (bits * i)
    return out.reshape(n, k // per_byte)


def unpack_bits(packed: Tensor, bits: int, group_size: int) -> Tensor:
    """Inverse of `pack_bits`: uint8 [N, K * bits // 8] -> uint8 codes [N, K]."""
    if bits not in (2, 4):
        raise ValueError(f"unpack_bits supports 2 or 4 bits, got {bits}")
    n, kb = packed.shape
    per_byte = 8 // bits
    sub = group_size // per_byte
    if kb % sub:
        raise ValueError(f"packed width {kb} is not a multiple of group_size // {per_byte} = {sub}")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device).view(1, 1, per_byte, 1)
    grouped = packed.reshape(n, kb // sub, 1, sub)
    codes = (grouped >> shifts) & ((1 << bits) - 1)
    return codes.reshape(n, kb * per_byte)


# ------------------------------------------------------------------------------------------------ int8 weights
@dataclass(frozen=True)
class Int8Weight:
    """Weight-only int8; per-channel when group_size is None (scales [N, 1]) else group-wise (scales [N, G])."""

    qweight: Tensor
    scales: Tensor
    group_size: int | None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[0]), int(self.qweight.shape[1])

    @property
    def kind(self) -> str:
        return "int8_channel" if self.group_size is None else "int8_group"

    def tensors(self) -> dict[str, Tensor]:
        return {"qweight": self.qweight, "scales": self.scales}


def quantize_int8(weight: Tensor, group_size: int | None = None) -> Int8Weight:
    """Symmetric round-to-nearest int8 with one fp32 scale per row (or per row-group)."""
    n, k = _check_2d(weight)
    if group_size is not None:
        _check_group(k, group_size, GROUP_SIZES, "int8")
    gs = k if group_size is None else group_size
    w = weight.detach().float().reshape(n, k // gs, gs)
    scales = (w.abs().amax(-1) / INT8_QMAX).clamp_min(_MIN_SCALE)
    q = torch.round(w / scales[..., None]).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return Int8Weight(q.reshape(n, k).contiguous(), scales.contiguous(), group_size)


# ------------------------------------------------------------------------------------------- int4/int2 weights
@dataclass(frozen=True)
class Int4Weight:
    """Weight-only int4, packed 2 per byte; w = (q - 8) * scale + zero (zeros None when symmetric)."""

    qweight: Tensor
    scales: Tensor
    zeros: Tensor | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[0]), int(self.qweight.shape[1]) * 2

    @property
    def kind(self) -> str:
        return "int4"

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def codes(self) -> Tensor:
        return unpack_bits(self.qweight, 4, self.group_size)

    def tensors(self) -> dict[str, Tensor]:
        out = {"qweight": self.qweight, "scales": self.scales}
        if self.zeros is not None:
            out["zeros"] = self.zeros
        return out


@dataclass(frozen=True)
class Int2Weight:
    """Weight-only int2, packed 4 per byte; w = (q - 2) * scale + zero."""

    qweight: Tensor
    scales: Tensor
    zeros: Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[0]), int(self.qweight.shape[1]) * 4

    @property
    def kind(self) -> str:
        return "int2"

    def codes(self) -> Tensor:
        return unpack_bits(self.qweight, 2, self.group_size)

    def tensors(self) -> dict[str, Tensor]:
        return {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}


def _minmax_codes(weight: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric min-max RTN: codes in [0, 2**bits - 1], scale, and zero = min + mid * scale."""
    n, k = int(weight.shape[0]), int(weight.shape[1])
    levels = (1 << bits) - 1
    mid = 1 << (bits - 1)
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo = w.amin(-1)
    hi = w.amax(-1)
    scales = ((hi - lo) / levels).clamp_min(_MIN_SCALE)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp_(0, levels).to(torch.uint8)
    zeros = lo + mid * scales
    return q.reshape(n, k), scales.contiguous(), zeros.contiguous()


def quantize_int4(weight: Tensor, group_size: int = 128, *, symmetric: bool = False) -> Int4Weight:
    """Group-wise int4 RTN. Asymmetric (min-max) is the default: it is what int4 LLM checkpoints use and it keeps
    one more effective level than symmetric for skewed groups."""
    n, k = _check_2d(weight)
    _check_group(k, group_size, GROUP_SIZES, "int4")
    if symmetric:
        w = weight.detach().float().reshape(n, k // group_size, group_size)
        scales = (w.abs().amax(-1) / 7).clamp_min(_MIN_SCALE)
        q = (torch.round(w / scales[..., None]).clamp_(-8, 7) + 8).to(torch.uint8).reshape(n, k)
        return Int4Weight(pack_bits(q, 4, group_size), scales.contiguous(), None, group_size)
    q, scales, zeros = _minmax_codes(weight, 4, group_size)
    return Int4Weight(pack_bits(q, 4, group_size), scales, zeros, group_size)


def quantize_int2(weight: Tensor, group_size: int = 128) -> Int2Weight:
    _, k = _check_2d(weight)
    _check_group(k, group_size, INT2_GROUP_SIZES, "int2")
    q, scales, zeros = _minmax_codes(weight, 2, group_size)
    return Int2Weight(pack_bits(q, 2, group_size), scales, zeros, group_size)


# ------------------------------------------------------------------------------------------------------ w8a8
@dataclass(frozen=True)
class W8A8Weight:
    """int8 per-channel weights of W * smooth, used with per-token dynamic int8 activations of x / smooth."""

    qweight: Tensor
    scales: Tensor
    smooth: Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[0]), int(self.qweight.shape[1])

    @property
    def kind(self) -> str:
        return "w8a8"

    def tensors(self) -> dict[str, Tensor]:
        smooth = self.smooth
        if smooth is None:
            # Stored explicitly (as ones) so every w8a8 layer has the same state-dict keys.
            smooth = torch.ones(self.shape[1], dtype=torch.float32, device=self.qweight.device)
        return {"qweight": self.qweight, "scales": self.scales, "smooth": smooth}


def smoothquant_factors(act_absmax: Tensor, weight: Tensor, alpha: float = 0.5) -> Tensor:
    """SmoothQuant per-input-channel factors s_j = max|X_j|^a / max|W_j|^(1-a), from calibration statistics.

    Dividing activations by s (and multiplying weight columns by s) moves outlier magnitude from activations,
    which are quantized per token, into weights, which are quantized per channel."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    a = act_absmax.detach().float().clamp_min(1e-5)
    w = weight.detach().float().abs().amax(0).clamp_min(1e-5)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s)).contiguous()


def quantize_w8a8(weight: Tensor, smooth: Tensor | None = None) -> W8A8Weight:
    n, k = _check_2d(weight)
    w = weight.detach().float()
    if smooth is not None:
        if smooth.shape != (k,):
            raise ValueError(f"smooth must have shape ({k},), got {tuple(smooth.shape)}")
        smooth = smooth.detach().float().contiguous()
        w = w * smooth[None, :]
    q = quantize_int8(w, None)
    return W8A8Weight(q.qweight, q.scales.reshape(n).contiguous(), smooth)


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric int8 per row of x [M, K] -> (int8 [M, K], fp32 scale [M, 1])."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / INT8_QMAX).clamp_min(_MIN_SCALE)
    q = torch.round(xf / scale).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return q, scale


# ------------------------------------------------------------------------------------------------ int8 KV cache
def quantize_kv(x: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize K or V [T, H, D] (any leading dims) to int8 with one fp32 scale per (token, head): ([T,H,D], [T,H]).

    Per (token, head) scales let a paged cache quantize each new token on write without revisiting old ones."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / KV_QMAX).clamp_min(_MIN_SCALE)
    q = torch.round(xf / scale[..., None]).clamp_(-KV_QMAX, KV_QMAX).to(torch.int8)
    return q, scale


def dequantize_kv(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)


PackedWeight = Int8Weight | Int4Weight | Int2Weight | W8A8Weight


def fit_spec(spec: str, k: int) -> str:
    """The spec a layer with K inputs actually gets: its group size lowered as `effective_group_size` does."""
    name, _, group = spec.partition("-g")
    if not group:
        return spec
    return f"{name}-g{effective_group_size(k, int(group))}"


def quantize(weight: Tensor, spec: str) -> PackedWeight:
    """Quantize by format spec: 'int8' (per-channel), 'int8-g<G>', 'int4-g<G>' (asymmetric), 'int4s-g<G>'
    (symmetric), 'int2-g128', 'w8a8'. Used by benchmarks and calibration, which speak in specs."""
    name, _, group = spec.partition("-g")
    gs = int(group) if group else None
    if name == "int8":
        return quantize_int8(weight, gs)
    if name in ("int4", "int4s"):
        return quantize_int4(weight, gs or 128, symmetric=name == "int4s")
    if name == "int2":
        return quantize_int2(weight, gs or 128)
    if name == "w8a8" and gs is None:
        return quantize_w8a8(weight)
    raise ValueError(f"unknown format spec {spec!r}; e.g. int8, int8-g128, int4-g128, int4s-g64, int2-g128, w8a8")
