"""glowplug's native CPU kernels against their pure-torch references, and the artifact-store build around them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from glowplug.kernels import formats, reference
from glowplug.kernels import native as native_mod
from glowplug.kernels.native import (
    native_linear,
    pack_blocked,
    prepare_native,
)

SHAPES = [(960, 576), (576, 1536), (100, 96), (37, 64)]  # SmolLM2's, and N not a multiple of the 16-row block
# single rows, partial and whole 8-row blocks; AMX tiles (4+ rows): partial, padded, four 16-row tiles at once (64),
# and a fifth tile that reuses the block the first four dequantized (72); N-blocks run in pairs, so the odd block
# counts of N=100 and N=37 also take the single-block path
BATCHES = [1, 3, 4, 8, 11, 16, 20, 64, 72]


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory, native_build) -> Path:  # type: ignore[no-untyped-def]
    build = native_build
    if not build.available:
        pytest.skip(f"native kernels unavailable here: {build.reason}")
    return tmp_path_factory.getbasetemp()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_dense_blocked_matches_reference(native: Path, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    wp, _ = pack_blocked(w)
    got = torch.ops.glowplug_native.dense_blocked(x, wp, n)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # the layout decodes back to the weight exactly, and the product matches fp32 to bf16 output rounding
    assert torch.equal(reference.dequantize_blocked(wp, n, k, 16, 0), w.float())
    assert _rel_err(got, x.float() @ w.float().t()) < 1e-2


@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("spec", ["int8", "int8-g32", "int4-g32", "int4-g64", "int4s-g32", "int2-g32", "int2-g64"])
def test_packed_blocked_match_reference(native: Path, spec: str, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + len(spec))
    w = torch.randn(n, k, generator=g) * 0.05
    packed = formats.quantize(w, formats.fit_spec(spec, k))
    st = prepare_native(packed, torch.bfloat16)
    assert st is not None
    x = torch.randn(m, k, generator=g).bfloat16()
    got = native_linear(x, st)
    # Against the layout's own oracle (same operands), and against the canonical format's reference: the blocked
    # layout keeps int4/int2 scales and mins in fp16, so the latter allows for that rounding too.
    assert _rel_err(got, reference.native_linear(x, st.kind, st.tensors, n, k, st.bits, st.group_size)) < 1e-2
    assert _rel_err(got, reference.linear(x.float(), packed)) < 2e-2


@pytest.mark.parametrize("m", BATCHES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_row_major_fp32_and_w8a8_match_reference(native: Path, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    got = torch.ops.glowplug_native.dense_linear(x, w, 1000)
    torch.testing.assert_close(got, reference.native_linear(x, "dense", (w,), n, k), atol=1e-4, rtol=1e-4)
    q = formats.quantize_w8a8(w)
    st = prepare_native(q, torch.float32)
    assert st is not None and st.kind == "w8a8"
    # The integer pipeline is exact; only the final fp32 multiply rounds.
    torch.testing.assert_close(native_linear(x, st), reference.linear(x, q), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 20, 64])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64), (100, 96)])
def test_w8a8_with_smoothing_and_bf16_activations_matches_reference(native: Path, m: int, n: int, k: int) -> None:
    """The engine's w8a8 case: bf16 activations, SmoothQuant's per-input factors folded into the kernel's
    quantization of x (the AMX path from 2 rows when K % 64 == 0, VNNI otherwise)."""
    g = torch.Generator().manual_seed(7 * m + n)
    smooth = torch.rand(k, generator=g) * 4 + 0.25
    q = formats.quantize_w8a8(torch.randn(n, k, generator=g) * 0.05, smooth)
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    st = prepare_native(q, torch.bfloat16)
    assert st is not None and st.tensors[3].numel() == k
    got = native_linear(x, st)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    ref = reference.linear(x, q)
    # x * (1 / smooth) against the reference's x / smooth can move an activation by one int8 step; then bf16 output.
    err = (got.float() - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative Frobenius error {err:.2e}"
    torch.testing.assert_close(got.float(), ref, atol=0.05 * ref.abs().max().item(), rtol=2e-2)


def test_a_switched_layer_reports_the_native_kernel(native: Path) -> None:
    from glowplug.kernels.modules import DecodeKernel, QuantLinear

    mod = QuantLinear.from_packed(formats.quantize(torch.randn(100, 96) * 0.05, "int4-g32"))
    switch = mod.enable_native(16, torch.bfloat16)
    assert switch.kind == "quantized" and switch.switched and mod.kernel is DecodeKernel.NATIVE
    assert mod.native is not None and switch.nbytes == mod.native.nbytes > 0


def test_a_damaged_library_is_rebuilt(tmp_path: Path) -> None:
    """The library is an artifact-store entry: truncate the cached .so and a new process rebuilds it (a process
    that already loaded the library keeps it, so the check runs in a fresh interpreter)."""
    import subprocess
    import sys

    script = (
        "import sys; from pathlib import Path; from glowplug.kernels.native import load_native; "
        "b = load_native(Path(sys.argv[1])); print(b.available, b.cache_hit, b.path)"
    )

    # No prebuilt variants: the cache's own build is what this checks.
    env = {**os.environ, "GLOWPLUG_NATIVE_PREBUILT": str(tmp_path / "no-prebuilt")}

    def run() -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True, env=env
        )
        return out.stdout.strip().splitlines()[-1].split()  # the last line: store events may log before it

    available, hit, path = run()
    if available != "True":
        pytest.skip("native kernels unavailable here")
    assert hit == "False"
    assert run()[:2] == ["True", "True"]
    so = Path(path)
    so.write_bytes(so.read_bytes()[:4096])  # truncated
    available, hit, _ = run()
    assert available == "True" and hit == "False"
    assert run()[:2] == ["True", "True"]


def test_int8_fixed_point_activations_stay_below_bf16_rounding(native: Path) -> None:
    """The int8 kernel multiplies 16-bit fixed-point activations (per 32 inputs): with an outlier 1000x the rest in
    every block, the result still matches the exact product of the bf16 inputs to bf16 output rounding, and matches
    its oracle (`reference.quantize_x16`) closer still."""
    g = torch.Generator().manual_seed(3)
    n, k = 576, 1536
    packed = formats.quantize(torch.randn(n, k, generator=g) * 0.05, "int8")
    st = prepare_native(packed, torch.bfloat16)
    assert st is not None
    x = torch.randn(4, k, generator=g) * 0.05
    x[:, ::32] = 50.0
    x = x.bfloat16()
    got = native_linear(x, st).float()
    exact = x.float() @ reference.dequantize(packed).t()
    assert _rel_err(got, exact) < 8e-3
    oracle = reference.native_linear(x, st.kind, st.tensors, n, k, st.bits, st.group_size)
    assert float((got - oracle).abs().max()) <= float(oracle.abs().max()) * 2**-8


@pytest.mark.parametrize("m", [1, 3])  # below the AMX batches, which multiply bf16 activations
@pytest.mark.parametrize(("spec", "n", "k"), [("int4-g32", 960, 576), ("int4-g64", 37, 1536), ("int4-g128", 100, 256)])
def test_int4_int8_activations_match_their_oracle(native: Path, spec: str, n: int, k: int, m: int) -> None:
    """From the AVX2 level up the int4 kernel takes the activations to int8 per (row, weight group): with an outlier
    100x the rest in every group, the rest round to a few codes, so the result is far from the fp32 product but
    matches `reference.quantize_x8`'s to bf16 output rounding. The portable level keeps fp32 activations."""
    g = torch.Generator().manual_seed(n + k + m)
    packed = formats.quantize(torch.randn(n, k, generator=g) * 0.05, formats.fit_spec(spec, k))
    st = prepare_native(packed, torch.bfloat16)
    assert st is not None
    gs = st.group_size
    x = torch.randn(m, k, generator=g)
    x[:, 5::gs] = 100.0
    x = x.bfloat16()
    got = native_linear(x, st).float()
    int8 = native_mod.loaded_level() not in (None, "portable")
    oracle = reference.native_linear(x, st.kind, st.tensors, n, k, st.bits, gs, int8_activations=int8)
    other = reference.native_linear(x, st.kind, st.tensors, n, k, st.bits, gs, int8_activations=not int8)
    bound = float(oracle.abs().max()) * 2**-8
    assert float((got - oracle).abs().max()) <= bound
    assert float((other - oracle).abs().max()) > 2 * bound  # the two oracles tell the paths apart
