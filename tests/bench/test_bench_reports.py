"""Report hygiene shared by the benchmarks: what the kernel rows count, quality flags, `bench all`'s orchestration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glowplug.kernels.bench import DEFAULT_BENCH_FORMATS, bench_kernels, render_markdown
from glowplug.kernels.dispatch import DEFAULT_FORMATS
from glowplug.profiling.bench.quality import flags_from_perplexity, load_flags


def test_calibration_covers_the_default_models_int4_g32() -> None:
    assert "int4-g32" in DEFAULT_FORMATS and "int4-g32" in DEFAULT_BENCH_FORMATS


def test_int2_rows_count_the_bytes_the_int4_kernel_reads() -> None:
    rows = bench_kernels([(64, 256)], ms=(1,), formats=("int4-g64", "int2-g64"), repeats=1, stream_bytes=1 << 16)
    aten = {r["format"]: r for r in rows if r["path"] == "aten_int4"}
    # int2 is widened to 4-bit codes for aten's int4 kernel: it reads int4's bytes, although it stores half the codes
    assert aten["int2-g64"]["read_bytes"] == aten["int4-g64"]["read_bytes"]
    assert aten["int2-g64"]["canonical_bytes"] < aten["int2-g64"]["read_bytes"]
    assert aten["int2-g64"]["gbps"] == aten["int2-g64"]["read_bytes"] / aten["int2-g64"]["us"] / 1e3
    md = render_markdown(rows, {"int2": "⚠ unusable: perplexity 5e+05 = 2e+04x bf16's"})
    assert all("⚠" in line for line in md.splitlines() if "| int2-g64 |" in line or "int2-g64 ⚠" in line)
    assert sum("int2-g64 ⚠" in line for line in md.splitlines()) == sum(r["format"] == "int2-g64" for r in rows)


def test_kernel_rows_show_median_and_spread_over_at_least_three_calls() -> None:
    rows = bench_kernels([(64, 256)], ms=(1,), formats=("bf16", "int8"), repeats=5, stream_bytes=1 << 16)
    assert rows
    for r in rows:
        assert 3 <= r["samples"] <= 5
        assert r["us_min"] <= r["us"] <= r["us_max"]  # "us" is the median, not the fastest call
        assert r["gbps"] == r["read_bytes"] / r["us"] / 1e3
    md = render_markdown(rows)
    assert "µs, median (min–max)" in md.splitlines()[0]
    body = [line for line in md.splitlines()[2:] if line]
    assert len(body) == len(rows) and all("(n=1)" not in line and "–" in line for line in body)


def test_quality_flags_mark_formats_over_twice_bf16_perplexity(tmp_path: Path) -> None:
    flags = flags_from_perplexity({"int8": 10.5, "int4": 19.9, "int2": 5e5}, reference=10.0)
    assert set(flags) == {"int2"} and "5e+05" in flags["int2"]
    path = tmp_path / "accuracy.json"
    path.write_text(json.dumps({"reference_perplexity": 10.0, "perplexity": {"int4": 20.5}}))
    assert set(load_flags(path)) == {"int4"}
    assert load_flags(None) == {}


def test_bench_all_quick_subset_writes_readme_and_reports(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The orchestration on the tiny model: reports land under --out only, in the stated order, and the README names
    each command, the commit, the machine with its probe, and says the run is a --quick smoke test. A second chunk
    (--only) at the same commit adds to the README instead of replacing it."""
    from glowplug.profiling.bench import machine
    from glowplug.profiling.bench.all import SIDECAR, STEP_NAMES, BenchAllConfig, plan_steps, run_all

    # One clean commit for both chunks, whatever state this checkout is in (the refusal is tested on its own).
    commit = "c" * 40
    monkeypatch.setattr(machine, "git_state", lambda exclude=None, repo=None: machine.GitState(commit, False))

    out = tmp_path / "out"
    cfg = BenchAllConfig(
        model=tiny_model, out=out, quick=True, only=("decode-quantized", "accuracy"), quantization=("int4",)
    )
    steps = plan_steps(cfg)
    assert [s.name for s in steps] == ["accuracy", "decode-quantized"]  # the fixed order, whatever --only said
    assert "--quality-from" in steps[1].argv  # later tables flag formats from the accuracy report
    full = plan_steps(BenchAllConfig(out=out))
    assert [s.name for s in full] == list(STEP_NAMES)
    assert all(any(str(out) in a for a in s.argv) for s in full)  # every report writes under --out
    assert [s.name for s in plan_steps(BenchAllConfig(out=out, skip=("accuracy", "serve-fuzz")))] == [
        n for n in STEP_NAMES if n not in ("accuracy", "serve-fuzz")
    ]
    results = run_all(cfg, ["bench", "all", "--quick"])
    assert [r.returncode for r in results] == [0, 0], [
        (out / "logs" / f"{r.step.name}.log").read_text()[-2000:] for r in results
    ]
    readme = (out / "README.md").read_text()
    assert "QUICK SMOKE TESTS, NOT MEASUREMENTS" in readme
    assert f"- commit: `{commit}`" in readme and "GB/s" in readme and "`glowplug bench all --quick`" in readme
    assert "`glowplug bench accuracy " in readme and "[decode-quantized.md](decode-quantized.md)" in readme
    # Reports not run yet are still listed with the command that makes them (the serve reports included).
    assert readme.count("| not run yet |") == len(STEP_NAMES) - 2 and "`glowplug bench serve " in readme
    assert (out / "accuracy.json").is_file()
    decode = (out / "decode-quantized.md").read_text()
    assert "| bfloat16 | int4" in decode and "(n=1)" in decode and "± 0" not in decode
    assert f"- commit: {commit}" in decode  # the run's commit, handed to the report's process

    # Second chunk: only kernels, at the same commit. The first chunk's rows stay, the new one joins the same run,
    # and the kernel table still flags formats from the first chunk's accuracy.json.
    second = BenchAllConfig(model=tiny_model, out=out, quick=True, only=("kernels",), quantization=("int4",))
    assert "--quality-from" in plan_steps(second)[0].argv
    assert [r.returncode for r in run_all(second, ["bench", "all", "--quick", "--only", "kernels"])] == [0]
    merged = (out / "README.md").read_text()
    assert "[decode-quantized.md](decode-quantized.md)" in merged and "[kernels.md](kernels.md)" in merged
    assert merged.count("| not run yet |") == len(STEP_NAMES) - 3
    assert "`glowplug bench all --quick`" in merged and "MIXED" not in merged  # one run: the first chunk's header
    entries = json.loads((out / SIDECAR).read_text())["entries"]
    assert set(entries) == {"accuracy", "decode-quantized", "kernels"}
    assert all(e["returncode"] == 0 and e["quick"] for e in entries.values())
