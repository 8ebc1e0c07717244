"""The start-up and tune reports from hand-made start-up reports (no process spawned): one startup.json holding every
start, --from-runs reading it and the older per-start files alike, seed 004's rows as sums of glowplug's phases, tune's
statistics over >= 3 starts per length, and the plots getting the data the JSON holds."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_no_blank_or_nan, markdown_cells

from glowplug.profiling.bench import plots, vllm_startup_rows
from glowplug.profiling.bench.startup_bench import (
    StartupBenchConfig,
    StartupBenchResult,
    render_markdown,
    runs_from_folder,
    write_reports,
)
from glowplug.profiling.bench.startup_runs import StartupRun
from glowplug.profiling.bench.tune import TuneMaxModelLenConfig, TuneResult, column_from_runs
from glowplug.profiling.bench.tune import render_markdown as tune_markdown
from glowplug.profiling.bench.tune import write_reports as tune_reports

LEAVES = {  # a hand-made phase table: leaf -> seconds (graph_compile_cached did not run)
    "process_start": 0.1,
    "imports": 0.9,
    "model_prepare": 0.7,
    "tokenizer_init": 0.05,
    "load_weights": 0.2,
    "model_init": 0.4,
    "quantize_weights": 0.01,
    "native_kernels": 0.25,
    "dynamo_transform_time": 2.5,
    "graph_compile_general_shape": 12.0,
    "graph_compile_cached": None,
    "kv_cache_profiling": 0.01,
    "kv_cache_init": 0.02,
    "graph_capturing": 0.05,
    "warmup": 0.04,
    "unattributed": 0.03,
}
OVERLAP = 0.06


def report(scale: float = 1.0) -> dict[str, Any]:
    """A start-up report as `glowplug startup --report-out` writes it, every leaf times `scale`."""
    leaves = {k: None if v is None else v * scale for k, v in LEAVES.items()}
    ran = [v for v in leaves.values() if v is not None]
    phases: dict[str, float | None] = {
        **leaves,
        "overlap": OVERLAP,
        "total_time": sum(ran) - 0.13,
        "actual_total_time": sum(ran) - OVERLAP,
    }
    kinds = {**{k: "leaf" for k in LEAVES}, "overlap": "derived", "total_time": "total", "actual_total_time": "total"}
    return {
        "phases": phases,
        "kinds": kinds,
        "reasons": {"graph_compile_cached": "cold: nothing cached"},
        "attributes": {"quantize_weights": {"glowplug.cache_hit": scale < 1}},
        "versions": {"glowplug": "t"},
    }


def test_seed_rows_are_sums_of_the_phases_they_name() -> None:
    phases = report()["phases"]
    leaves = list(LEAVES)
    got = vllm_startup_rows.map_phases(phases, leaves)
    assert got["model_loading"] == pytest.approx(0.7 + 0.2 + 0.4 + 0.01)
    assert got["torch.compile (= dynamo)"] == pytest.approx(2.5)
    assert got["graph compile"] == pytest.approx(12.0)  # the cached half did not run: 0 s, not a gap
    assert got["graph_capturing"] == pytest.approx(0.05)
    # vLLM compiles inside its KV profile run: the seed's init_engine holds the compile leaves.
    assert got["init_engine"] == pytest.approx(0.25 + 2.5 + 12.0 + 0.01 + 0.02 + 0.05 + 0.04)
    assert got["tokenizer_init"] == pytest.approx(0.05)
    total = got["model_loading"] + got["init_engine"] + got["tokenizer_init"]  # the seed's definition
    assert got[vllm_startup_rows.TOTAL] == pytest.approx(total)
    actual = phases["actual_total_time"]
    assert got[vllm_startup_rows.ACTUAL] == pytest.approx(actual)
    # The gap the seed's total leaves: process start, imports, unattributed, less the overlap.
    assert got[vllm_startup_rows.UNACCOUNTED] == pytest.approx(0.1 + 0.9 + 0.03 - OVERLAP)
    assert got[vllm_startup_rows.ACCOUNTED] == pytest.approx(actual)  # every second of the wall clock
    # The seed's own numbers: its total_time is model_loading + init_engine + tokenizer_init in every column.
    for model, columns in vllm_startup_rows.SEED_004.items():
        for length, c in columns.items():
            assert c["total_time"] == pytest.approx(
                c["model_loading"] + c["init_engine"] + c["tokenizer_init"], abs=0.02
            ), (model, length)
            assert c["torch.compile"] == c["dynamo_transform_time"]
    assert vllm_startup_rows.seed_values("qwen-4b", vllm_startup_rows.UNACCOUNTED)[1024] == pytest.approx(65.65 - 51.12)


def bench_result(tmp_path: Path, plots_on: bool = False) -> StartupBenchResult:
    cfg = StartupBenchConfig(model="smollm2", runs=3, out_dir=tmp_path / "out", plots=plots_on)
    runs: dict[str, list[StartupRun]] = {
        m: [] for m in ("cold", "warm", "bundle", "bundle_isa_capped", "cold_after_warm", "otlp_off", "otlp_on")
    }
    for i, s in enumerate((1.0, 1.1, 0.9), 1):
        runs["cold"].append(StartupRun(f"cold {i}", 0, 20.0, report(s)))
        runs["warm"].append(StartupRun(f"warm {i}", 0, 2.0, report(0.1 * s)))
    for i in (1, 2):
        runs["otlp_off"].append(StartupRun(f"otlp_off {i}", 0, 2.0, report(0.1)))
        runs["otlp_on"].append(StartupRun(f"otlp_on {i}", 0, 2.0, report(0.101)))
    return StartupBenchResult(cfg, runs, None)  # type: ignore[arg-type]


def test_startup_json_holds_every_run_and_from_runs_reads_both_forms(tmp_path: Path) -> None:
    result = bench_result(tmp_path)
    write_reports(result)
    out = tmp_path / "out"
    # No per-run files: the report, its JSON and its verdicts (read by `bench all`).
    assert sorted(p.name for p in out.iterdir()) == ["startup.json", "startup.md", "startup.verdicts.json"]
    data = json.loads((out / "startup.json").read_text())
    every = [(m, r) for m, rs in result.runs.items() for r in rs]
    assert len(data["runs"]) == len(every)
    for entry in data["runs"]:
        run = next(r for m, r in every if r.label == entry["label"] and m == entry["mode"])
        assert entry["report"] == run.report  # what the per-run file held

    # An older version's folder: one file per start.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for mode, rs in result.runs.items():
        for i, r in enumerate(rs, 1):
            (legacy / f"{mode}-{i}.json").write_text(json.dumps(r.report))
    cfg = StartupBenchConfig(model="smollm2", runs=3, out_dir=tmp_path / "re", plots=False)
    for source in (out / "startup.json", out, legacy):
        StartupBenchConfig(from_runs=source)  # the flag accepts it
        back = runs_from_folder(cfg, source)
        for mode in ("cold", "warm", "otlp_off", "otlp_on"):
            assert [r.phases for r in back.runs[mode]] == [r.phases for r in result.runs[mode]], (source, mode)
    again = runs_from_folder(cfg, out / "startup.json")
    assert render_markdown(again).split("## Phases")[1] == render_markdown(result).split("## Phases")[1]


def test_startup_seed_table_is_the_medians_of_the_mapped_runs(tmp_path: Path) -> None:
    md = render_markdown(bench_result(tmp_path))
    assert_no_blank_or_nan(md)
    rows = {r[0]: r for r in markdown_cells(md.split("## Beside seed 004")[1].split("##")[0])}
    cold = [vllm_startup_rows.map_phases(report(s)["phases"], list(LEAVES))["init_engine"] for s in (1.0, 1.1, 0.9)]
    want = f"{statistics.median(cold):.2f} ({min(cold):.2f}–{max(cold):.2f}, n=3)"
    assert rows["init_engine"][2] == want
    assert rows[vllm_startup_rows.TOTAL][1].startswith("model_loading + init_engine + tokenizer_init")


def test_phase_plot_gets_the_json_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    real = plots.plot_phase_stack

    def spy(columns: Any, stacks: Any, path: Path, **kw: Any) -> Path:
        seen.update(columns=list(columns), stacks={k: list(v) for k, v in stacks.items()}, **kw)
        return real(columns, stacks, path, **kw)

    monkeypatch.setattr(plots, "plot_phase_stack", spy)
    write_reports(bench_result(tmp_path, plots_on=True))
    png = tmp_path / "out" / "startup_phases.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "out" / "startup.json").read_text())
    phase_runs = [r for r in data["runs"] if r["mode"] in ("cold", "warm")]
    assert seen["columns"] == [r["label"] for r in phase_runs]
    assert seen["groups"] == [r["mode"] for r in phase_runs]  # one panel per kind of start
    for leaf, values in seen["stacks"].items():
        assert values == [r["phases"].get(leaf) for r in phase_runs]
    assert seen["totals"] == [r["phases"]["actual_total_time"] for r in phase_runs]


def tune_runs(length: int, scales: tuple[float, ...], blocks: int) -> list[StartupRun]:
    out = []
    for i, s in enumerate(scales, 1):
        rep = report(0.1 * s)
        rep["attributes"]["kv_cache_profiling"] = {"glowplug.kv_blocks": blocks}
        out.append(StartupRun(f"max-model-len {length} run {i}", 0, 2.0, rep))
    return out


def test_tune_cells_are_median_and_spread_over_three_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = StartupRun("max-model-len 256 run 4", 1, 1.0, {}, "boom")
    columns = [
        column_from_runs(256, [*tune_runs(256, (1.0, 1.2, 0.8), 40), failed], 16),
        column_from_runs(512, tune_runs(512, (1.0, 1.1, 1.3), 40), 16),
    ]
    c = columns[0]
    assert c.n == 3 and len(c.failures) == 1 and c.ok
    imports = [0.09 * s for s in (1.0, 1.2, 0.8)]
    assert c.phases["imports"] == pytest.approx(statistics.median(imports))
    cfg = TuneMaxModelLenConfig(model="smollm2", out_dir=tmp_path / "tune", repeats=3)
    result = TuneResult(cfg, columns, "sweep", 8192)
    md = tune_markdown(result)
    assert_no_blank_or_nan(md)
    rows = {r[0]: r[1:] for r in markdown_cells(md)}
    assert rows["runs (n)"][:2] == ["3 (1 failed)", "3"]
    assert rows["imports"][0] == f"{statistics.median(imports):.2f} ({min(imports):.2f}–{max(imports):.2f})"
    assert rows["max concurrency"][:2] == ["2.50", "1.25"]  # 40 blocks / (256/16), / (512/16)
    assert "## Beside seed 004" in md and "seed qwen-4b 512" in md

    seen: dict[str, Any] = {}
    real_stack, real_kv = plots.plot_phase_stack, plots.plot_kv_capacity

    def spy_stack(columns: Any, stacks: Any, path: Path, **kw: Any) -> Path:
        seen["stack"] = (list(columns), kw)
        return real_stack(columns, stacks, path, **kw)

    def spy_kv(series: Any, path: Path, **kw: Any) -> Path:
        seen["kv"] = series
        return real_kv(series, path, **kw)

    monkeypatch.setattr(plots, "plot_phase_stack", spy_stack)
    monkeypatch.setattr(plots, "plot_kv_capacity", spy_kv)
    written = tune_reports(result)
    assert {p.name for p in written} == {"tune.md", "tune.json", "tune_phases.png", "tune_kv_capacity.png"}
    assert all(p.is_file() for p in written)
    data = json.loads((tmp_path / "tune" / "tune.json").read_text())
    cols, kw = seen["stack"]
    assert cols == [str(c["max_model_len"]) for c in data["columns"]]
    ready = [[p["actual_total_time"] for p in c["phases_per_run"]] for c in data["columns"]]
    assert kw["totals"] == [statistics.median(r) for r in ready]
    assert kw["total_spread"] == [(min(r), max(r)) for r in ready]
    assert "n=3" in kw["title"]
    ((label, points),) = seen["kv"].items()
    assert [(n, caps, conc) for n, caps, conc in points] == [
        (
            c["max_model_len"],
            [b * 16.0 for b in c["kv_blocks_per_run"]],
            [b / (c["max_model_len"] // 16) for b in c["kv_blocks_per_run"]],
        )
        for c in data["columns"]
    ]


def test_tune_sweep_runs_each_length_repeats_times_in_passes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from glowplug.profiling.bench import timing, tune

    order: list[tuple[int, int]] = []

    def fake_start(cfg: Any, length: int, tmp: Path, rep: int = 1) -> StartupRun:
        order.append((length, rep))
        return tune_runs(length, (1.0,), 40)[0]

    monkeypatch.setattr(tune, "_start", fake_start)
    monkeypatch.setattr(timing, "model_position_limit", lambda *a, **k: 1024)
    cfg = TuneMaxModelLenConfig(model="smollm2", max_model_len=(512, 256), out_dir=tmp_path / "t", repeats=3)
    result = tune.run_tune(cfg)
    assert order == [(256, 1), (512, 1), (256, 2), (512, 2), (256, 3), (512, 3)]
    assert [c.n for c in result.columns] == [3, 3]


def test_plot_kv_capacity_and_stack_render(tmp_path: Path) -> None:
    path = plots.plot_kv_capacity(
        {"a": [(256, [640.0] * 3, [2.5] * 3), (512, [640.0, 620.0, 650.0], [1.2, 1.3])]}, tmp_path / "kv.png", title="t"
    )
    assert path.read_bytes()[:4] == b"\x89PNG"
    colours = {plots.phase_style(i) for i in range(20)}
    assert len(colours) == 20  # every phase of a 20-row stack looks different


def test_a_missed_eta_target_is_a_fail_verdict_and_a_fail_in_the_bench_all_index(tmp_path: Path) -> None:
    """Issue 52: a report with targets says PASS or FAIL on its worst run, and `bench all` shows FAIL for the step
    although the command exited 0 (the real `bench startup --from-runs` re-renders the runs in a child process)."""
    from glowplug.profiling.bench import all as bench_all
    from glowplug.profiling.bench.machine import GitState
    from glowplug.profiling.bench.verdicts import failed_targets

    result = bench_result(tmp_path)
    for run in [*result.runs["cold"], *result.runs["warm"]]:
        actual = run.report["phases"]["actual_total_time"]
        eta = actual * (1.8 if run.label == "warm 1" else 1.05)  # the first warm start's ETA 80% off
        run.report["attributes"]["actual_total_time"] = {
            "glowplug.eta.first_ready_s": eta,
            "glowplug.eta.basis": "recorded",
        }
    write_reports(result)
    text = (tmp_path / "out" / "startup.md").read_text()
    verdicts = text[text.index("## Verdicts") :]
    assert "**FAIL**" in verdicts and "warm after cold" in verdicts and "warm 1: +80.0%" in verdicts
    assert "warm after warm" in verdicts  # the other kind, within its target
    assert failed_targets(tmp_path / "out" / "startup.md") == ["first ETA within 20% of READY (warm after cold)"]

    out = tmp_path / "all"
    (out / "logs").mkdir(parents=True)
    step = bench_all.Step(
        "startup",
        [
            "bench",
            "startup",
            "--from-runs",
            str(tmp_path / "out" / "startup.json"),
            "--no-plots",
            "--out-dir",
            str(out / "startup"),
        ],
        ["startup/startup.md"],
        "cold and warm starts",
    )
    r = bench_all.run_step(step, 300, out / "logs" / "startup.log", out, GitState("a" * 40, False).env())
    assert r.returncode == 0 and r.error is not None and r.error.startswith("FAIL: first ETA within 20%")
    run = {"command": "c", "commit": "a" * 40, "dirty": False, "date": "d", "machine": "m", "probe_gbps": None}
    readme = bench_all.render_readme(
        bench_all.BenchAllConfig(out=out),
        {"run": run, "entries": {"startup": bench_all.entry_of(r, False, "now", run)}},
    )
    row = next(ln for ln in readme.splitlines() if "startup/startup.md" in ln)
    assert "FAIL: first ETA within 20% of READY (warm after cold)" in row and "| ok |" not in row
