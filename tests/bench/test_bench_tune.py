"""`tune max-model-len` on the tiny model: a real sweep, and --plan predicting its KV rows from one start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_no_blank_or_nan, markdown_cells

from glowplug.profiling.bench.tune import (
    TuneMaxModelLenConfig,
    default_lengths,
    recommend,
    render_markdown,
    run_tune,
    write_reports,
)

BUDGET = 327_680  # 40 blocks of 16 tokens at the tiny model's 512 bytes/token


def test_default_lengths_are_numeric_powers_of_two() -> None:
    assert default_lengths(8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert default_lengths(3000) == [256, 512, 1024, 2048, 3000]


def test_plan_matches_sweep(tiny_model: str, tmp_path: Path) -> None:
    common = dict(model=tiny_model, kv_cache_memory=BUDGET, min_concurrency=3, cache_dir=tmp_path / "cache")
    sweep = run_tune(TuneMaxModelLenConfig(max_model_len=(256, 128), repeats=1, out_dir=tmp_path / "sweep", **common))
    plan_cfg = TuneMaxModelLenConfig(max_model_len=(512, 256, 128), plan=True, out_dir=tmp_path / "plan", **common)
    plan = run_tune(plan_cfg)

    assert [c.length for c in sweep.columns] == [128, 256]  # numeric order, whatever order was given
    assert all(c.ok for c in sweep.columns), [c.error for c in sweep.columns]
    measured = {c.length: (c.kv_blocks, c.token_capacity, c.max_concurrency) for c in sweep.columns}
    assert measured == {128: (40, 640, 5.0), 256: (40, 640, 2.5)}
    predicted = {c.length: (c.kv_blocks, c.token_capacity, c.max_concurrency) for c in plan.columns if c.ok}
    assert predicted == measured
    assert plan.measured_length == 128 and plan.budget_bytes == BUDGET and plan.bytes_per_token == 512
    over = next(c for c in plan.columns if c.length == 512)
    assert not over.ok and "exceeds the model's limit of 256" in (over.error or "")

    for result in (sweep, plan):
        rec = recommend(result)
        assert rec is not None and rec.length == 128 and rec.flags == ["--max-model-len", "128"]
        assert rec.exact_bound == 208  # floor(40 / 3) blocks x 16 tokens
        assert f"glowplug serve {tiny_model} --max-model-len 128 --kv-cache-memory {BUDGET}" in rec.text

    md = render_markdown(plan, ["tune", "max-model-len", "--plan"])
    assert_no_blank_or_nan(md)
    assert "Predicted from one start-up at max-model-len 128" in md
    rows = {r[0]: r[1:] for r in markdown_cells(md)}
    assert rows["KV blocks"][:2] == ["40", "40"] and rows["max concurrency"][:2] == ["5.00", "2.50"]
    assert rows["KV blocks"][2] == "n/a (--max-model-len 512 exceeds the model's limit of 256 positions)"
    write_reports(sweep)
    data = json.loads((tmp_path / "sweep" / "tune.json").read_text())
    assert data["recommendation"]["max_model_len"] == 128
    assert [c["max_model_len"] for c in data["columns"]] == [128, 256]
    assert (tmp_path / "sweep" / "tune_phases.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_writes_only_under_its_own_folder_in_the_cwd(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`glowplug tune max-model-len --plan` from some cwd writes ./tune-max-model-len/ and nothing else (it used to
    write ./reports/, i.e. the checkout's committed reports), and draws no plot of identical copied bars."""
    from glowplug.cli import main

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    argv = [
        "tune",
        "max-model-len",
        tiny_model,
        "--plan",
        "--max-model-len",
        "128,256",
        "--kv-cache-memory",
        str(BUDGET),
        "--cache-dir",
        str(tmp_path / "cache"),
    ]
    assert main(argv) == 0
    written = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*") if p.is_file())
    assert written and all(p.startswith("tune-max-model-len/") for p in written), written
    assert "tune-max-model-len/tune-plan.md" in written
    assert not any(p.endswith("_phases.png") for p in written)
    md = (cwd / "tune-max-model-len" / "tune-plan.md").read_text()
    assert "profiles once" in md
