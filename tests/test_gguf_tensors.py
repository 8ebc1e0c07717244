"""GGUF blocks read natively, against the gguf package's own de-quantizer (the reference) and transformers'
q/k un-permutation; the int4/int8 repacks against the formats' de-quantization; unsupported types refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from glowplug.engine.models import gguf_tensors as gt
from glowplug.engine.models.arch import ModelError
from glowplug.kernels.formats import Int8Weight, quantize_int4, unpack_bits

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _weights(n: int = 24, k: int = 128, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    # Skewed rows (as trained weights are) so Q4_1's offset matters.
    return (g.standard_normal((n, k)) * 0.05 + g.standard_normal((n, 1)) * 0.02).astype(np.float32)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, object]]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (arr, kind) in tensors.items():
        if kind in (Q.F32, Q.F16):
            w.add_tensor(name, arr.astype(np.float16 if kind == Q.F16 else np.float32))
        elif kind == Q.BF16:
            w.add_tensor(name, gguf.quants.quantize(arr, Q.BF16), raw_dtype=Q.BF16)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    kinds = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}
    return _write(tmp_path / "t.gguf", {f"{n}.weight": (_weights(seed=i), k) for i, (n, k) in enumerate(kinds.items())})


def _table(path: Path) -> tuple[gt.TensorTable, torch.Tensor, dict[str, object]]:
    reader = gguf.GGUFReader(path)
    table = gt.read_table(reader, path)
    return table, gt.map_file(path, table), {t.name: t for t in reader.tensors}


def test_every_type_unpacks_as_gguf_dequantize_does(gguf_file: Path) -> None:
    table, data, ref = _table(gguf_file)
    assert len(table.tensors) == 6
    for e in table.tensors:
        r = ref[e.name]
        want = torch.from_numpy(np.array(gguf.quants.dequantize(r.data, r.tensor_type), copy=True))
        got = gt.dequantize(gt.raw_bytes(data, e), e)
        assert got.shape == (24, 128) and got.dtype == torch.float32
        assert torch.equal(got, want.reshape(got.shape)), e.name  # bit for bit


@pytest.mark.parametrize("name", ["q4_0", "q4_1"])
def test_int4_repack_keeps_the_codes_and_the_grid(gguf_file: Path, name: str) -> None:
    table, data, ref = _table(gguf_file)
    e = next(t for t in table.tensors if t.name == f"{name}.weight")
    r = ref[e.name]
    want = torch.from_numpy(np.array(gguf.quants.dequantize(r.data, r.tensor_type), copy=True)).reshape(e.shape)
    packed = gt.repack_int4(gt.raw_bytes(data, e), e)
    codes = unpack_bits(packed["qweight"], 4, 32).float().reshape(24, 4, 32)
    scales, zeros = packed["scales"][..., None], packed["zeros"][..., None]
    # The formats' de-quantization of the repack is the GGUF's weights, up to one fp32 rounding of zero.
    got = ((codes - 8) * scales + zeros).reshape(e.shape)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # The codes are the file's own: recovered from the reference weights on the file's grid.
    lo = zeros - 8 * scales
    assert torch.equal(codes, torch.round((want.reshape(24, 4, 32) - lo) / scales))
    # De-quantizing and re-quantizing (the old path) rounds a second time; the repack never does worse.
    requant = quantize_int4(want, 32)
    rq = unpack_bits(requant.qweight, 4, 32).float().reshape(24, 4, 32)
    back = ((rq - 8) * requant.scales[..., None] + requant.zeros[..., None]).reshape(e.shape)
    assert (got - want).abs().max() <= (back - want).abs().max()


def test_int8_repack_is_exact(gguf_file: Path) -> None:
    table, data, ref = _table(gguf_file)
    e = next(t for t in table.tensors if t.name == "q8_0.weight")
    r = ref[e.name]
    want = torch.from_numpy(np.array(gguf.quants.dequantize(r.data, r.tensor_type), copy=True)).reshape(e.shape)
    w = Int8Weight(**gt.repack_int8(gt.raw_bytes(data, e), e), group_size=32)
    got = (w.qweight.float().reshape(24, 4, 32) * w.scales[..., None]).reshape(e.shape)
    assert torch.equal(got, want)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_matches_transformers(heads: int) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(heads * 64 * 5, dtype=np.float32).reshape(heads * 64, 5)
    want = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
    got = torch.from_numpy(w)[gt.unpermute_rows(heads * 64, heads)]
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)))


def test_unsupported_type_names_type_tensor_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 144), dtype=np.uint8), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match=r"blk\.0\.attn_q\.weight.*Q4_K.*llama-quantize"):
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
        assert a.data_offset == b.data_offset and np.array_equal(a.data, b.data)


def test_not_a_gguf_is_a_model_error(tmp_path: Path) -> None:
    from glowplug.engine.models.gguf_meta import open_reader

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelError, match="not a readable GGUF"):
        open_reader(bad)


def test_float_tensors_are_mapped_apart_and_exact(gguf_file: Path) -> None:
    table, data, _ = _table(gguf_file)
    floats = [e for e in table.tensors if e.type in (gt.F32, gt.F16, gt.BF16)]
    mapped = [gt.map_float(gguf_file, e) for e in floats]
    for e, t in zip(floats, mapped):
        assert torch.equal(t.float(), gt.dequantize(gt.raw_bytes(data, e), e))
    # One storage each: torch.compile refuses graph inputs that alias (views of one mapping would).
    assert len({t.untyped_storage().data_ptr() for t in mapped}) == len(mapped)
