"""GGUF blocks read natively, against the gguf package's own de-quantizer (the reference) and transformers'
q/k un-permutation; the int4/int8 repacks against the formats' de-quantization; unsupported types refused.

Every type glowplug reads is in one small file written here: the floats and legacy blocks quantized by gguf
itself, the K-quants (which gguf can de-quantize but not quantize) as random blocks with sane fp16 scales. A real
llama.cpp file, gemma-3-270m Q4_K_M, is checked too when it is on the machine (the `gemma3_gguf` fixture:
`glowplug models fetch gemma3-270m`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from glowplug.engine.models import gguf_blocks as gb
from glowplug.engine.models import gguf_tensors as gt
from glowplug.engine.models.arch import ModelError
from glowplug.kernels.formats import Int8Weight, quantize_int4, unpack_bits

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


# Rows and row length of every test tensor: two 256-weight K-quant super-blocks per row, sixteen 32-weight blocks.
N, K = 24, 512
FLOATS = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16}
LEGACY = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q8_0": Q.Q8_0}
K_QUANTS = {"q2_k": Q.Q2_K, "q3_k": Q.Q3_K, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
KINDS = {**FLOATS, **LEGACY, **K_QUANTS}
# Byte offsets of each K-quant's fp16 super-block scales (d, and dmin where it has one); every other byte of a
# block (6-bit scales, codes, high bits) is valid whatever its value.
_K_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _weights(n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    # Skewed rows (as trained weights are) so Q4_1's offset matters.
    return (g.standard_normal((n, k)) * 0.05 + g.standard_normal((n, 1)) * 0.02).astype(np.float32)


def _k_blocks(kind: object, n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    """Raw K-quant rows [n, bytes]: random blocks whose fp16 scales are small positive numbers (random bytes there
    could be inf or NaN)."""
    weights, nbytes = gguf.GGML_QUANT_SIZES[kind]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(n, k // weights, nbytes), dtype=np.uint8)
    for at in _K_SCALES[kind]:
        raw[..., at : at + 2] = g.uniform(1e-4, 2e-3, size=(n, k // weights, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, object]], arch: str = "llama") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for name, (arr, kind) in tensors.items():
        if kind in (Q.F32, Q.F16):
            w.add_tensor(name, arr.astype(np.float16 if kind == Q.F16 else np.float32))
        elif arr.dtype == np.uint8:  # raw blocks, written as they are
            w.add_tensor(name, arr, raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    tensors = {
        f"{n}.weight": (_k_blocks(k, seed=i) if k in K_QUANTS.values() else _weights(seed=i), k)
        for i, (n, k) in enumerate(KINDS.items())
    }
    return _write(tmp_path / "t.gguf", tensors)


def _table(path: Path) -> tuple[gt.TensorTable, torch.Tensor, dict[str, object]]:
    reader = gguf.GGUFReader(path)
    table = gt.read_table(reader, path)
    return table, gt.map_file(path, table), {t.name: t for t in reader.tensors}


def _oracle(r: Any) -> torch.Tensor:
    """gguf's de-quantization of a reader tensor (a gguf.ReaderTensor), fp32."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(r.data, r.tensor_type), copy=True))


def test_the_list_of_types_is_ggmls(gguf_file: Path) -> None:
    # The ids and block shapes spelled out in gguf_tensors (so a warm start need not import gguf) are ggml's.
    assert {Q(t).name for t in gt.TYPE_NAMES} == {gt.TYPE_NAMES[t] for t in gt.TYPE_NAMES}
    for t, shape in gb._BLOCK_SHAPE.items():
        assert gguf.GGML_QUANT_SIZES[Q(t)] == shape, gt.TYPE_NAMES[t]


def test_every_type_unpacks_as_gguf_dequantize_does(gguf_file: Path) -> None:
    table, data, ref = _table(gguf_file)
    assert {e.type for e in table.tensors} == set(gt.TYPE_NAMES)  # the file holds every type glowplug reads
    for e in table.tensors:
        got = gb.dequantize(gb.raw_bytes(data, e), e)
        assert got.shape == (N, K) and got.dtype == torch.float32
        assert torch.equal(got, _oracle(ref[e.name]).reshape(got.shape)), e.name  # bit for bit


def test_row_order_chunks_and_destination(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader's way in: rows reordered on the packed bytes, de-quantized a few rows at a time (5 here, so the
    last step is short) straight into a bf16 slice of a larger buffer."""
    monkeypatch.setattr(gb, "_CHUNK_WEIGHTS", 5 * K)
    table, data, ref = _table(gguf_file)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    for e in table.tensors:
        if e.type in (gt.F32, gt.F16, gt.BF16):
            continue
        buffer = torch.zeros((N + 3, K), dtype=torch.bfloat16)
        got = gb.dequantize(gb.raw_bytes(data, e), e, torch.bfloat16, order, buffer[3:])
        want = _oracle(ref[e.name]).reshape(N, K)[order].to(torch.bfloat16)
        assert torch.equal(got, want) and torch.equal(buffer[3:], want), e.name
        assert not buffer[:3].any()


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q4_k"])
def test_int4_repack_keeps_the_codes_and_the_grid(gguf_file: Path, name: str) -> None:
    table, data, ref = _table(gguf_file)
    e = next(t for t in table.tensors if t.name == f"{name}.weight")
    want = _oracle(ref[e.name]).reshape(e.shape)
    packed = gb.repack_int4(gb.raw_bytes(data, e), e)
    assert packed["qweight"].shape == (N, K // 2) and packed["scales"].shape == packed["zeros"].shape == (N, K // 32)
    codes = unpack_bits(packed["qweight"], 4, 32).float().reshape(N, K // 32, 32)
    scales, zeros = packed["scales"][..., None], packed["zeros"][..., None]
    # The formats' de-quantization of the repack is the GGUF's weights, up to the fp32 rounding of zero.
    got = ((codes - 8) * scales + zeros).reshape(e.shape)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # The codes are the file's own: recovered from the reference weights on the file's grid (a Q4_K sub-block
    # whose random 6-bit scale is 0 has no grid to recover them from).
    lo = zeros - 8 * scales
    on_grid = (scales != 0).expand_as(codes)
    recovered = torch.round((want.reshape(N, K // 32, 32) - lo) / scales)
    assert on_grid.any() and torch.equal(codes[on_grid], recovered[on_grid])
    if name == "q4_k":
        return  # random Q4_K codes are not what a re-quantization of their weights would choose
    # De-quantizing and re-quantizing (the old path) rounds a second time; the repack never does worse.
    requant = quantize_int4(want, 32)
    rq = unpack_bits(requant.qweight, 4, 32).float().reshape(N, K // 32, 32)
    back = ((rq - 8) * requant.scales[..., None] + requant.zeros[..., None]).reshape(e.shape)
    assert (got - want).abs().max() <= (back - want).abs().max()


@pytest.mark.parametrize("name", ["q8_0", "q5_0"])
def test_int8_repack_is_exact(gguf_file: Path, name: str) -> None:
    table, data, ref = _table(gguf_file)
    e = next(t for t in table.tensors if t.name == f"{name}.weight")
    want = _oracle(ref[e.name]).reshape(e.shape)
    w = Int8Weight(**gb.repack_int8(gb.raw_bytes(data, e), e), group_size=32)
    got = (w.qweight.float().reshape(N, K // 32, 32) * w.scales[..., None]).reshape(e.shape)
    assert torch.equal(got, want)


def test_pack_plan_takes_exact_layers_only() -> None:
    """A Q4_K_M-style layer: q/k/gate/up Q5_0, v Q8_0, o Q4_K, down Q6_K. int8 g32 takes the legacy blocks, int4
    g32 takes Q4_K; a fused projection goes whole or not at all; coarser groups take nothing."""

    def entry(name: str, kind: int, n: int, k: int) -> gt.TensorEntry:
        return gt.TensorEntry(name=name, type=kind, shape=(n, k), offset=0, nbytes=0)

    layer = "model.layers.0"
    kinds = {
        "self_attn.q_proj": gt.Q5_0,
        "self_attn.k_proj": gt.Q5_0,
        "self_attn.v_proj": gt.Q8_0,
        "self_attn.o_proj": gt.Q4_K,
        "mlp.gate_proj": gt.Q5_0,
        "mlp.up_proj": gt.Q5_0,
        "mlp.down_proj": gt.Q6_K,
    }
    entries = {f"{layer}.{m}.weight": entry(m, t, 256, 512) for m, t in kinds.items()}
    modules = lambda *ms: {f"{layer}.{m}" for m in ms}  # noqa: E731
    assert gt._packable(entries, gt.PackPlan("int8", 32)) == modules(
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"
    )
    assert gt._packable(entries, gt.PackPlan("int4", 32)) == modules("self_attn.o_proj")
    assert gt._packable(entries, gt.PackPlan("int4", 128)) == set()
    # A Q4_K member among Q5_0 ones keeps the fused q/k/v out of the int8 repack (and int4 has no Q5_0).
    entries[f"{layer}.self_attn.v_proj.weight"] = entry("v", gt.Q4_K, 256, 512)
    assert gt._packable(entries, gt.PackPlan("int8", 32)) == modules("mlp.gate_proj", "mlp.up_proj")


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_matches_transformers(heads: int) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(heads * 64 * 5, dtype=np.float32).reshape(heads * 64, 5)
    want = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
    got = torch.from_numpy(w)[gt.unpermute_rows(heads * 64, heads)]
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)))


def test_unsupported_type_names_type_tensor_and_fix(tmp_path: Path) -> None:
    path = _write(tmp_path / "iq.gguf", {"blk.0.attn_q.weight": (np.zeros((4, 18), dtype=np.uint8), Q.IQ4_NL)})
    with pytest.raises(ModelError, match=r"blk\.0\.attn_q\.weight.*IQ4_NL.*reads F32, .*Q4_K.*Q6_K.*llama-quantize"):
        gt.read_table(gguf.GGUFReader(path), path)


def test_changed_file_is_refused(gguf_file: Path) -> None:
    table, _, _ = _table(gguf_file)
    with gguf_file.open("ab") as f:
        f.write(b"\0" * 64)
    with pytest.raises(ModelError, match="changed after it was prepared"):
        gt.map_file(gguf_file, table)


def test_fast_reader_reads_what_the_stock_reader_reads(gguf_file: Path) -> None:
    from glowplug.engine.models.gguf_meta import open_reader

    fast, stock = open_reader(gguf_file), gguf.GGUFReader(gguf_file)
    assert list(fast.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert fast.fields[key].contents() == field.contents(), key
    assert [t.name for t in fast.tensors] == [t.name for t in stock.tensors]
    for a, b in zip(fast.tensors, stock.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == [int(d) for d in b.shape]
        assert a.data_offset == b.data_offset and a.n_bytes == int(b.n_bytes)


def test_not_a_gguf_is_a_model_error(tmp_path: Path) -> None:
    from glowplug.engine.models.gguf_meta import open_reader

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelError, match="not a readable GGUF"):
        open_reader(bad)


@pytest.mark.parametrize("keep", [0.001, 0.5])
def test_a_file_cut_short_is_a_model_error(gguf_file: Path, tmp_path: Path, keep: float) -> None:
    """Cut inside the metadata, or inside the tensor data: refused by name, before anything is mapped."""
    from glowplug.engine.models.gguf_meta import open_reader

    data = gguf_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelError, match="not a readable GGUF"):
        open_reader(cut)


def test_float_tensors_are_mapped_apart_and_exact(gguf_file: Path) -> None:
    table, data, _ = _table(gguf_file)
    floats = [e for e in table.tensors if e.type in (gt.F32, gt.F16, gt.BF16)]
    mapped = [gt.map_float(gguf_file, e) for e in floats]
    for e, t in zip(floats, mapped):
        assert torch.equal(t.float(), gb.dequantize(gb.raw_bytes(data, e), e))
    # One storage each: torch.compile refuses graph inputs that alias (views of one mapping would).
    assert len({t.untyped_storage().data_ptr() for t in mapped}) == len(mapped)


@pytest.mark.slow
def test_a_real_k_quant_file_reads_every_tensor(gemma3_gguf: Path) -> None:
    """gemma-3-270m Q4_K_M as llama.cpp wrote it (Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors)."""
    from glowplug.engine.models.gguf_meta import open_reader

    path = gemma3_gguf
    reader = open_reader(path)  # the prepare path's reader and table
    table = gt.read_table(reader, path)
    data = gt.map_file(path, table)
    ref = {t.name: t for t in gguf.GGUFReader(path).tensors}  # the oracle: gguf's own reader and dequantizers
    assert {gt.TYPE_NAMES[e.type] for e in table.tensors} >= {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    for e in table.tensors:
        r = ref[e.name]
        if e.name == "token_embd.weight":
            # 262144 x 640: its first 4096 rows are enough, and spare two 670 MB fp32 copies.
            e = e.model_copy(update={"shape": (4096, e.shape[1]), "nbytes": e.nbytes * 4096 // e.shape[0]})
            want = torch.from_numpy(np.array(gguf.quants.dequantize(r.data[:4096], r.tensor_type), copy=True))
        else:
            want = _oracle(r)
        want = want.reshape(e.shape)
        assert torch.equal(gb.dequantize(gb.raw_bytes(data, e), e), want), e.name
        if e.type == gt.Q4_K:
            p = gb.repack_int4(gb.raw_bytes(data, e), e)
            codes = unpack_bits(p["qweight"], 4, 32).float().reshape(e.shape[0], -1, 32)
            got = ((codes - 8) * p["scales"][..., None] + p["zeros"][..., None]).reshape(e.shape)
            torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=0)
        elif e.type in (gt.Q5_0, gt.Q8_0):
            w = Int8Weight(**gb.repack_int8(gb.raw_bytes(data, e), e), group_size=32)
            assert torch.equal(
                (w.qweight.float().reshape(e.shape[0], -1, 32) * w.scales[..., None]).reshape(e.shape), want
            ), e.name
