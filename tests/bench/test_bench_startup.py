"""`bench startup` with one cold and one warm start of the tiny model, each in a fresh process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_no_blank_or_nan

from glowplug.profiling.bench.startup_bench import (
    StartupBenchConfig,
    cache_hit_counts,
    phase_stat,
    render_markdown,
    run_startup_bench,
    write_reports,
)


def test_cold_then_warm(tiny_model: str, tmp_path: Path) -> None:
    cfg = StartupBenchConfig(model=tiny_model, runs=1, kv_cache_memory=327_680, out_dir=tmp_path / "out")
    result = run_startup_bench(cfg)
    (cold,), (warm,) = result.runs["cold"], result.runs["warm"]
    assert cold.ok and warm.ok, (cold.error, warm.error)
    # Cold: an empty cache, so the KV profile is measured; warm: the cold run's cache, so it is a hit.
    assert cold.cache_hits()["kv_cache_profiling"] is False
    assert warm.cache_hits()["kv_cache_profiling"] is True
    assert cold.phases["kv_cache_profiling"] is not None and cold.phases["kv_cache_profiling"] > 0
    assert warm.phases["kv_cache_profiling"] is None and warm.reasons["kv_cache_profiling"] == "cache hit"
    for run in (cold, warm):
        leaves = [v for k, v in run.phases.items() if run.report["kinds"][k] == "leaf" and v is not None]
        assert sum(leaves) == pytest.approx(run.phases["actual_total_time"], abs=1e-6)  # unattributed closes it
    assert cache_hit_counts(result.runs["warm"])["kv_cache_profiling"] == (1, 1)

    ready = phase_stat(result.runs["cold"], "actual_total_time")
    assert ready.summary is not None and ready.summary.p50 == pytest.approx(cold.phases["actual_total_time"])
    missing = phase_stat(result.runs["warm"], "kv_cache_profiling")
    assert missing.summary is None and missing.why == "cache hit"

    md = render_markdown(result, ["bench", "startup", "--runs", "1"])
    assert_no_blank_or_nan(md)
    assert "n/a (cache hit)" in md and "| kv_cache_profiling | 0 of 1 | 1 of 1 |" in md
    write_reports(result)
    data = json.loads((tmp_path / "out" / "startup.json").read_text())
    assert [r["mode"] for r in data["runs"]] == ["cold", "warm"]
    assert data["summary"]["warm"]["kv_cache_profiling"]["note"] == "cache hit in 1 of 1 runs"
    assert (tmp_path / "out" / "startup_phases.png").read_bytes()[:4] == b"\x89PNG"
