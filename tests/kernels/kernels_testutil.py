"""Shared helpers for the kernel tests (imported by path-insensitive name; no fixtures here)."""

from __future__ import annotations

import torch
from torch import Tensor

# Formats exercised everywhere, with the (N, K) shapes each accepts. N=72 is not a multiple of 16 (aten int4
# block) and K=200 not a multiple of 16/32 (int8pack, nibble planes), so the padding/validity logic is covered.
FORMATS: tuple[str, ...] = ("int8", "int8-g64", "int4-g32", "int4-g64", "int4s-g32", "int2-g128", "w8a8")
SHAPES: tuple[tuple[int, int], ...] = ((72, 192), (80, 256), (48, 200))
MS: tuple[int, ...] = (1, 3, 16, 64)


def fits(spec: str, k: int) -> bool:
    _, _, group = spec.partition("-g")
    return not group or k % int(group) == 0


def cases() -> list[tuple[str, int, int]]:
    return [(spec, n, k) for spec in FORMATS for n, k in SHAPES if fits(spec, k)]


def rel_errors(y: Tensor, ref: Tensor) -> tuple[float, float]:
    """(max |y - ref| / max |ref|, ||y - ref|| / ||ref||) in fp32."""
    y, ref = y.float(), ref.float()
    diff = (y - ref).abs()
    denom_max = ref.abs().max().clamp_min(1e-6)
    denom_fro = ref.norm().clamp_min(1e-6)
    return float(diff.max() / denom_max), float((y - ref).norm() / denom_fro)


def assert_matches(y: Tensor, ref: Tensor, *, max_rel: float, fro_rel: float, what: str = "") -> None:
    """Loose enough for bf16 arithmetic (errors ~3e-3), tight enough that any layout/scale bug (errors ~1) fails."""
    assert y.shape == ref.shape, f"{what}: shape {tuple(y.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(y).all(), f"{what}: non-finite output"
    e_max, e_fro = rel_errors(y, ref)
    assert e_max <= max_rel and e_fro <= fro_rel, f"{what}: max-rel {e_max:.2e}, fro-rel {e_fro:.2e}"


# bf16 kernels vs the fp32 oracle fed the same (bf16-representable) inputs.
BF16_TOL = {"max_rel": 3e-2, "fro_rel": 1e-2}
# w8a8 integer pipelines: only float rounding in the epilogue differs from the oracle.
W8A8_TOL = {"max_rel": 1e-4, "fro_rel": 1e-5}


def tol_for(spec: str) -> dict[str, float]:
    return W8A8_TOL if spec == "w8a8" else BF16_TOL
