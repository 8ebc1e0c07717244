"""The native GGUF ops (kernels/native/gguf.cpp) against their oracles in kernels/reference.py, which de-quantize the
stored blocks with the gguf package: every type at row lengths with tails (a partial activation tile, an odd number
of weight rows, more rows than one thread's share), fp32 and bf16 activations, fused parts of mixed types with a
permuted part, and the batch invariance the engine relies on (a row's output does not depend on the rows beside it).
tests/kernels/test_isa_levels.py runs this file at every ISA level the CPU has."""

from __future__ import annotations

import pytest
import torch

from glowplug.kernels import reference as R
from glowplug.kernels.gguf import BLOCKS, FLOATS, IN_PLACE, TYPE_NAMES, GGUFEmbedding, GGUFLinear, GGUFRows

# Where each block type keeps its fp16 scale fields (random bytes there could be NaN or huge).
SCALES_AT = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
TYPES = sorted(IN_PLACE | FLOATS)
E8, E32 = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int32)


@pytest.fixture(scope="module")
def native(native_build) -> None:  # type: ignore[no-untyped-def]
    if not native_build.available:
        pytest.skip(f"native kernels unavailable here: {native_build.reason}")


def stored_rows(ggml_type: int, n: int, k: int, seed: int) -> torch.Tensor:
    """n random stored rows of k weights: random codes and bits, small positive fp16 scales."""
    g = torch.Generator().manual_seed(seed)
    weights, nbytes = BLOCKS[ggml_type]
    if ggml_type in FLOATS:
        dtype = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}[ggml_type]
        return torch.randn(n, k, generator=g).to(dtype).view(torch.uint8).reshape(n, -1).contiguous()
    raw = torch.randint(0, 256, (n, k // weights, nbytes), dtype=torch.uint8, generator=g)
    for at in SCALES_AT[ggml_type]:
        d = (torch.rand(n, k // weights, generator=g) * 0.01 + 0.001).half()
        raw[..., at : at + 2] = d.view(torch.uint8).reshape(n, k // weights, 2)
    return raw.reshape(n, -1).contiguous()


def linear(x: torch.Tensor, *parts: tuple[torch.Tensor, int, torch.Tensor | None]) -> torch.Tensor:
    args: list[object] = []
    for i in range(3):
        if i < len(parts):
            rows, t, perm = parts[i]
            args += [rows, t, E32 if perm is None else perm]
        else:
            args += [E8, 0, E32]
    out: torch.Tensor = torch.ops.glowplug_native.gguf_linear(x, *args)
    return out


def check(y: torch.Tensor, x: torch.Tensor, parts: list[tuple[torch.Tensor, int, torch.Tensor | None]]) -> None:
    """y against the float64 oracle: within fp32 accumulation error of the sum of |terms| (and one bf16 rounding of
    the result when x is bf16)."""
    want = R.gguf_linear(x, parts)
    k = x.shape[1]
    mags = []
    for rows, t, perm in parts:
        w = R.gguf_dequantize(rows, t, k).double().abs()
        m = x.double().abs() @ w.t()
        mags.append(m if perm is None else torch.empty_like(m).index_copy_(1, perm.long(), m))
    bound = torch.cat(mags, dim=1) * 2e-5 + 1e-6
    if y.dtype == torch.bfloat16:
        bound = bound + want.abs() * 2**-8
    err = (y.double() - want).abs()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: TYPE_NAMES[t])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_type_matches_the_reference(native: None, ggml_type: int, m: int, dtype: torch.dtype) -> None:
    k = 768 if BLOCKS[ggml_type][0] == 256 else 736  # 3 super-blocks; 23 blocks (an odd count)
    rows = stored_rows(ggml_type, 37, k, seed=ggml_type * 10 + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = linear(x, (rows, ggml_type, None))
    assert y.dtype == dtype and y.shape == (m, 37)
    check(y, x, [(rows, ggml_type, None)])


def test_many_rows_split_across_threads(native: None) -> None:
    """More bytes than one thread's share (the row ranges split by bytes, not rows, across two types)."""
    k = 1024
    a, b = stored_rows(12, 301, k, 1), stored_rows(14, 77, k, 2)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(3))
    check(linear(x, (a, 12, None), (b, 14, None)), x, [(a, 12, None), (b, 14, None)])


def test_fused_parts_of_mixed_types_with_a_permuted_part(native: None) -> None:
    k = 512
    q, kk, v = stored_rows(12, 64, k, 4), stored_rows(8, 32, k, 5), stored_rows(1, 32, k, 6)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(7)).to(torch.int32)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    parts = [(q, 12, perm), (kk, 8, None), (v, 1, None)]
    check(linear(x, *parts), x, parts)


def test_strided_rows_a_column_slice_of_the_stored_matrix(native: None) -> None:
    """A K-slice of stored rows (tensor parallelism's row-parallel layer takes whole blocks of each row)."""
    full = stored_rows(12, 40, 1024, 9)
    part = full[:, 144 : 144 * 3]  # super-blocks 1 and 2 of every row
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(10))
    check(linear(x, (part, 12, None)), x, [(part, 12, None)])


@pytest.mark.parametrize("ggml_type", [12, 14, 3, 8], ids=lambda t: TYPE_NAMES[t])
def test_a_rows_output_does_not_depend_on_the_batch(native: None, ggml_type: int) -> None:
    """Batch invariance: row r alone, among 16 rows, and at another position of a batch of 7 gives the same bits."""
    k = 512
    rows = stored_rows(ggml_type, 50, k, 11)
    g = torch.Generator().manual_seed(12)
    batch = torch.randn(16, k, generator=g).bfloat16()
    together = linear(batch, (rows, ggml_type, None))
    for r in (0, 5, 15):
        alone = linear(batch[r : r + 1].contiguous(), (rows, ggml_type, None))
        assert torch.equal(alone[0], together[r])
        moved = torch.cat([batch[:3], batch[r : r + 1], batch[8:11]]).contiguous()
        assert torch.equal(linear(moved, (rows, ggml_type, None))[3], together[r])


# Every quantized type: a prompt's rows (or a batch's, from 8 rows for the 4- and 5-bit 32-weight blocks, from 16 for
# the rest) run them through an unpacked-panel GEMM (the K-quants' and the 32-weight blocks' own), whose outputs must
# be the single-row GEMV tiles' bits.
QUANTIZED = sorted(IN_PLACE)


@pytest.mark.parametrize("ggml_type", QUANTIZED, ids=lambda t: TYPE_NAMES[t])
@pytest.mark.parametrize(("m", "n", "k"), [(8, 19, 512), (16, 8, 256), (17, 37, 768), (35, 21, 2304), (64, 301, 1024)])
def test_prompt_sized_batches_match_the_reference_and_the_single_row_op(
    native: None, ggml_type: int, m: int, n: int, k: int
) -> None:
    """A prompt's rows (a partial activation tile, weight rows that leave a partial panel and tile, super-blocks that
    leave a partial K-block) against the oracle, and every row bit for bit against the same row computed alone."""
    rows = stored_rows(ggml_type, n, k, seed=ggml_type * 100 + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).bfloat16()
    y = linear(x, (rows, ggml_type, None))
    check(y, x, [(rows, ggml_type, None)])
    for r in range(m):
        assert torch.equal(linear(x[r : r + 1].contiguous(), (rows, ggml_type, None))[0], y[r]), f"row {r}"


def test_a_prompt_through_fused_parts_of_gemm_and_gemv_types(native: None) -> None:
    """A fused layer whose parts take different paths at prompt size (a K-quant and a 32-weight block type their
    GEMMs, a float part the GEMV tiles), one of them permuted, in fp32: the oracle, and each row as computed alone."""
    k = 512
    q, kk, v = stored_rows(12, 40, k, 21), stored_rows(8, 24, k, 22), stored_rows(1, 19, k, 23)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(24)).to(torch.int32)
    parts = [(q, 12, perm), (kk, 8, None), (v, 1, None)]
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(25))
    y = linear(x, *parts)
    check(y, x, parts)
    for r in (0, 4, 20):
        assert torch.equal(linear(x[r : r + 1].contiguous(), *parts)[0], y[r])


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: TYPE_NAMES[t])
def test_rows_lookup_matches_the_reference(native: None, ggml_type: int) -> None:
    k = 512
    rows = stored_rows(ggml_type, 40, k, ggml_type)
    ids = torch.tensor([3, 0, 39, 3, 17])
    want = R.gguf_rows(rows, ggml_type, k, ids)
    assert torch.equal(torch.ops.glowplug_native.gguf_rows(rows, ggml_type, k, ids, 0), want)
    assert torch.equal(torch.ops.glowplug_native.gguf_rows(rows, ggml_type, k, ids, 1), want.bfloat16())
    strided = torch.stack([ids, ids], dim=1)[:, 0]  # a column of a packed batch
    assert torch.equal(torch.ops.glowplug_native.gguf_rows(rows, ggml_type, k, strided, 0), want)


def test_bad_input_names_the_problem(native: None) -> None:
    rows = stored_rows(12, 4, 512, 0)
    with pytest.raises(RuntimeError, match="takes 288"):
        linear(torch.randn(1, 512), (rows[:, :100].contiguous(), 12, None))
    with pytest.raises(RuntimeError, match="has no native kernel"):
        linear(torch.randn(1, 512), (rows, 10, None))
    with pytest.raises(RuntimeError, match="not a multiple of the 256-weight block"):
        linear(torch.randn(1, 500), (rows, 12, None))
    with pytest.raises(RuntimeError, match="outside the 4 rows"):
        torch.ops.glowplug_native.gguf_rows(rows, 12, 512, torch.tensor([4]), 0)


def test_the_modules_and_their_dense_fallback(native: None) -> None:
    """GGUFLinear (with a bias) and GGUFEmbedding against the de-quantized ordinary layers `to_dense` makes."""
    k = 256
    parts = [GGUFRows(stored_rows(12, 24, k, 1), 12), GGUFRows(stored_rows(6, 8, k, 2), 6)]
    layer = GGUFLinear(k, parts, bias=True)
    layer.bias = torch.nn.Parameter(torch.randn(32), requires_grad=False)
    x = torch.randn(2, 3, k)
    dense = layer.to_dense(torch.float32)
    # int8 activations against fp32 ones: within a percent of the sum of |terms|
    scale = x.abs() @ dense.weight.abs().t()
    assert bool(((layer(x) - dense(x)).abs() <= 0.01 * scale + 1e-4).all())
    assert layer.nbytes == sum(p.nbytes for p in parts)
    emb = GGUFEmbedding(GGUFRows(stored_rows(13, 50, k, 3), 13), k, torch.bfloat16)
    ids = torch.tensor([[1, 49], [0, 7]])
    assert torch.equal(emb(ids), emb.to_dense()(ids))
