"""Every CPU kernel path against the fp32 oracle, for M in {1, 3, 16, 64} and odd shapes."""

from __future__ import annotations

import pytest
import torch
from kernels_testutil import MS, assert_matches, cases, tol_for

from glowplug.kernels import cpu
from glowplug.kernels import formats as F
from glowplug.kernels import reference as R
from glowplug.kernels.dispatch import Dispatcher, kernel_paths


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    # bf16-representable inputs, so the oracle and a bf16 kernel see the same activations.
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(("spec", "n", "k"), cases())
def test_every_cpu_path_matches_reference(spec: str, n: int, k: int) -> None:
    w = F.quantize(_weight(n, k), spec)
    disp = Dispatcher()
    paths = [p for p in disp.valid_paths(w) if p != "reference"]
    assert paths, f"no fast CPU path for {spec} {n}x{k}"
    rt = disp.prepare(w, paths)
    for m in MS:
        x = _x(m, k, seed=m)
        ref = R.linear(x, w)
        for path in paths:
            limit = kernel_paths()[path].max_m
            if limit is not None and m > limit:
                continue
            y = disp.run_path(path, x, rt)
            assert_matches(y, ref, **tol_for(spec), what=f"{spec} {n}x{k} M={m} {path}")


def test_expected_paths_are_valid() -> None:
    disp = Dispatcher()
    # Padding keeps the aten kernels usable for N % 16 != 0 and int8pack for K % 16 != 0.
    assert {"int8pack", "aten_int4", "dequant_bf16"} <= set(disp.valid_paths(F.quantize(_weight(72, 192), "int8")))
    assert "int8pack" in disp.valid_paths(F.quantize(_weight(72, 200), "int8"))
    # Nibble planes need a group size in 32..256 dividing K: K=200 has none.
    assert "aten_int4" not in disp.valid_paths(F.quantize(_weight(72, 200), "int8"))
    assert {"aten_int4", "dequant_bf16"} <= set(disp.valid_paths(F.quantize(_weight(72, 256), "int2-g128")))
    assert {"int_mm", "int_mm_rows"} <= set(disp.valid_paths(F.quantize(_weight(72, 256), "w8a8")))


def test_w8a8_with_smoothing_matches_reference() -> None:
    k = 192
    w = _weight(80, k)
    smooth = torch.rand(k, generator=torch.Generator().manual_seed(3)) * 4 + 0.25
    q = F.quantize_w8a8(w, smooth)
    disp = Dispatcher()
    rt = disp.prepare(q, ["int_mm", "int_mm_rows"])
    for m in (1, 3, 17):
        x = _x(m, k, seed=m) * 3
        ref = R.linear(x, q)
        for path in ("int_mm", "int_mm_rows"):
            # x * (1/s) vs x / s may round a code differently: allow one int8 step on a few elements.
            assert_matches(disp.run_path(path, x, rt), ref, max_rel=2e-2, fro_rel=5e-3, what=path)


def test_workspace_shared_between_layers_of_different_shapes() -> None:
    # Two layers alternate through one dispatcher's workspace; a stale or aliased buffer would corrupt results.
    disp = Dispatcher()
    a = F.quantize(_weight(64, 256, seed=1), "int4-g64")
    b = F.quantize(_weight(160, 128, seed=2), "int8-g32")
    ra, rb = disp.prepare(a, ["dequant_bf16"]), disp.prepare(b, ["dequant_bf16"])
    xa, xb = _x(5, 256), _x(7, 128)
    for _ in range(2):
        ya = disp.run_path("dequant_bf16", xa, ra)
        yb = disp.run_path("dequant_bf16", xb, rb)
        assert_matches(ya, R.linear(xa, a), **tol_for("int4"), what="a")
        assert_matches(yb, R.linear(xb, b), **tol_for("int8"), what="b")
    assert disp.workspace.nbytes() >= 64 * 256 * 2
    # Without a workspace (the torch.compile route) the path allocates and gives the same answer.
    st = cpu.prepare_dequant(a)
    assert torch.equal(cpu.run_dequant(xa, st, None), disp.run_path("dequant_bf16", xa, ra))


def test_workspace_path_runs_outside_inference_mode_after_running_inside() -> None:
    # The engine runs under torch.inference_mode(), benchmarks and callers may not: a scratch buffer first made
    # inside is an inference tensor, and reusing it outside raised "Inplace update to inference tensor".
    disp = Dispatcher()
    a = F.quantize(_weight(64, 256, seed=3), "int4-g64")
    ra = disp.prepare(a, ["dequant_bf16"])
    x = _x(5, 256)
    with torch.inference_mode():
        inside = disp.run_path("dequant_bf16", x, ra)
    outside = disp.run_path("dequant_bf16", x, ra)
    assert torch.equal(inside, outside)
    assert_matches(outside, R.linear(x, a), **tol_for("int4"), what="outside")


def test_fp32_activations_are_cast_for_the_aten_kernels() -> None:
    w = F.quantize(_weight(64, 128), "int4-g32")
    x = torch.randn(2, 128)
    st = cpu.prepare_aten_int4(w)
    y = cpu.run_aten_int4(x, st)
    assert y.dtype == torch.bfloat16
    assert_matches(y, R.linear(x, w), max_rel=3e-2, fro_rel=1e-2)
