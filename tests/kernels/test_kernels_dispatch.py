"""Dispatcher: valid choices by M/shape/device, JSON table round trip, calibration cached on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kernels_testutil import assert_matches, cases, tol_for

from glowplug.kernels import dispatch as D
from glowplug.kernels import formats as F
from glowplug.kernels import reference as R
from glowplug.kernels.bench import bench_kernels, render_markdown


def _w(spec: str, n: int = 64, k: int = 256) -> F.PackedWeight:
    return F.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05, spec)


@pytest.mark.parametrize(("spec", "n", "k"), cases())
def test_default_choice_is_prepared_valid_and_correct(spec: str, n: int, k: int) -> None:
    disp = D.Dispatcher()
    w = _w(spec, n, k)
    rt = disp.prepare(w)
    valid = set(disp.valid_paths(w))
    assert set(rt.states) <= valid
    for m in (1, 2, 3, 4, 8, 16, 33, 64, 256):
        path = disp.choose(rt, m)
        assert path in rt.states and path in valid and path != "reference"
        limit = D.kernel_paths()[path].max_m
        assert limit is None or m <= limit
    x = torch.randn(16, k).to(torch.bfloat16)
    assert_matches(disp.linear(x, rt), R.linear(x, w), **tol_for(spec), what=spec)


def test_default_rules_follow_the_measured_crossover() -> None:
    disp = D.Dispatcher()
    rt8, rt4, rta = disp.prepare(_w("int8")), disp.prepare(_w("int4-g64")), disp.prepare(_w("w8a8"))
    assert [disp.choose(rt8, m) for m in (1, 4, 64, 256)] == ["int8pack", "int8pack", "dequant_bf16", "dequant_bf16"]
    assert [disp.choose(rt4, m) for m in (1, 16, 256)] == ["aten_int4", "aten_int4", "dequant_bf16"]
    assert [disp.choose(rta, m) for m in (1, 2, 16, 256)] == ["int_mm_rows", "int_mm_rows", "int_mm", "int_mm"]
    # Only what some M can reach is prepared (no aten planes for per-channel int8 under the default rules).
    assert set(rt8.states) == {"int8pack", "dequant_bf16"}


def test_unpreparable_rule_falls_back() -> None:
    table = D.DispatchTable(rules={"cpu/int8_channel": [(None, "int8pack")]})
    disp = D.Dispatcher(table)
    w = _w("int8")
    rt = disp.prepare(w, ["dequant_bf16"])  # int8pack not prepared: must fall back, not fail
    assert disp.choose(rt, 1) == "dequant_bf16"


def test_table_json_round_trip_and_nearest_m() -> None:
    table = D.DispatchTable(
        measured={D.shape_key("cpu", "int4", 64, 64, 256): [(1, "aten_int4"), (64, "dequant_bf16")]}
    )
    again = D.DispatchTable.from_json(table.to_json())
    assert again.rules == table.rules and again.measured == table.measured

    def lookup(m: int) -> str:
        first: str = again.lookup("cpu", "int4", 64, 64, 256, m)[0]
        return first

    assert [lookup(m) for m in (1, 7, 9, 64, 1000)] == [
        "aten_int4",
        "aten_int4",
        "dequant_bf16",
        "dequant_bf16",
        "dequant_bf16",
    ]
    bad = json.loads(table.to_json())
    bad["version"] = 999
    with pytest.raises(ValueError, match="version"):
        D.DispatchTable.from_json(json.dumps(bad))


def test_calibration_caches_json_and_reuses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = [(64, 256), (48, 128)]
    kwargs = {"formats": ("int8", "int4-g64", "w8a8"), "ms": (1, 16), "repeats": 2, "stream_bytes": 1 << 20}
    table = D.calibrate(shapes, tmp_path, **kwargs)
    files = list((tmp_path / "kernel_dispatch").glob("*/table.json"))
    assert len(files) == 1
    manifest = json.loads((files[0].parent / "manifest.json").read_text())
    assert manifest["factors"] == D.calibration_factors(shapes, kwargs["formats"], kwargs["ms"])
    meta = json.loads(files[0].read_text())["meta"]
    assert meta["torch"] == torch.__version__ and meta["cpu"] == D.cpu_model()
    assert len(table.measured) == len(shapes) * 3
    for key, entries in table.measured.items():
        assert [m for m, _ in entries] == [1, 16]
        timings = meta["timings_us"][key]
        for m, path in entries:
            assert timings[str(m)][path] == min(timings[str(m)].values())  # the winner is the fastest measured

    # Layers whose K the configured group does not divide are calibrated at the group they will really use.
    odd = D.calibrate([(32, 192)], tmp_path / "odd", formats=("int4-g128",), ms=(1,), repeats=1, stream_bytes=1 << 16)
    assert list(odd.measured) == [D.shape_key("cpu", "int4", 64, 32, 192)]

    # Second call: served from the cache file, no benchmarking.
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("re-benchmarked despite a cache hit")

    monkeypatch.setattr(D, "measure_path_samples", boom)
    again = D.calibrate(shapes, tmp_path, **kwargs)
    assert again.measured == table.measured

    # The calibrated table drives choices for calibrated shapes.
    disp = D.Dispatcher(again)
    w = _w("int4-g64", 64, 256)
    rt = disp.prepare(w)
    expected = dict(again.measured[D.shape_key("cpu", "int4", 64, 64, 256)])
    assert disp.choose(rt, 1) == expected[1] and disp.choose(rt, 16) == expected[16]
    # A different shape list is a different cache key.
    from glowplug.base.artifacts import ArtifactStore
    from glowplug.base.artifacts.caches import KERNEL_DISPATCH

    other = ArtifactStore.key(KERNEL_DISPATCH, D.calibration_factors([(64, 256)], kwargs["formats"], kwargs["ms"]))
    assert other != files[0].parent.name


def test_bench_rows_and_markdown() -> None:
    rows = bench_kernels(
        [(64, 256)],
        ms=(1, 16),
        formats=("bf16", "int8", "int4-g64", "int2-g128", "w8a8"),
        repeats=2,
        stream_bytes=1 << 20,
    )
    formats = {r["format"] for r in rows}
    assert formats == {"bf16", "int8", "int4-g64", "int2-g128", "w8a8"}
    for fmt in formats:
        for m in (1, 16):
            group = [r for r in rows if r["format"] == fmt and r["m"] == m]
            assert sum(r["chosen"] for r in group) == 1, (fmt, m)
            assert all(r["dispatch"] == next(g["path"] for g in group if g["chosen"]) for r in group)
            for r in group:
                assert r["us"] > 0 and r["gbps"] > 0
                assert r["gflops"] == pytest.approx(2 * m * 64 * 256 / r["us"] / 1e3, rel=0.02)
    md = render_markdown(rows)
    assert md.startswith("| shape (NxK) | format | M | path |")
    assert md.count("\n") == len(rows) + 2
    # int4 g128 does not divide K=192: measured as the g64 layer the registry would build, and labelled so.
    odd = bench_kernels([(16, 192)], ms=(1,), formats=("int4-g128", "int4-g64"), repeats=1, stream_bytes=1 << 16)
    assert {r["format"] for r in odd} == {"int4-g64"}
    assert len({r["path"] for r in odd}) == len(odd)  # the duplicate spec was measured once
