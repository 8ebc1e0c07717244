"""`bench startup` with one cold and one warm start of the tiny model, each in a fresh process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_no_blank_or_nan

from glowplug.profiling.bench.startup_bench import (
    StartupBenchConfig,
    bundle_figures,
    cache_hit_counts,
    eta_figures,
    phase_stat,
    render_markdown,
    run_startup_bench,
    tracing_overhead,
    write_reports,
)


def test_cold_then_warm(tiny_model: str, tmp_path: Path) -> None:
    # int8: the quantized weights are the cache whose outcome the table shows (the KV peak is analytic on the CPU,
    # no cache). Eager: the compile rows have tests of their own, and the starts a bundle adds stay cheap.
    cfg = StartupBenchConfig(
        model=tiny_model, runs=1, kv_cache_memory=327_680, quantization="int8", out_dir=tmp_path / "out", compile="off"
    )
    result = run_startup_bench(cfg)
    (cold,), (warm,) = result.runs["cold"], result.runs["warm"]
    assert cold.ok and warm.ok, (cold.error, warm.error)
    # Cold: an empty cache, so the weights are quantized; warm: the cold run's cache, so it is a hit.
    assert cold.cache_hits()["quantize_weights"] is False
    assert warm.cache_hits()["quantize_weights"] is True
    assert cold.phases["quantize_weights"] is not None and cold.phases["quantize_weights"] > 0
    # A hit reads its cache: that time is booked to the row, and the row says it was a hit.
    assert warm.phases["quantize_weights"] is not None
    assert warm.report["notes"]["quantize_weights"][0] == "cache hit"
    for run in (cold, warm):
        # The oracle is the parent's clock: the child's process creation -> READY is inside the child's lifetime.
        assert 0.3 * run.wall_s < run.phases["actual_total_time"] <= run.wall_s
    assert cache_hit_counts(result.runs["warm"])["quantize_weights"] == (1, 1)

    ready = phase_stat(result.runs["cold"], "actual_total_time")
    assert ready.summary is not None and ready.summary.p50 == pytest.approx(cold.phases["actual_total_time"])

    # Tracing overhead: one start without and one with export, the receiver really got the spans.
    (off,), (on,) = result.runs["otlp_off"], result.runs["otlp_on"]
    assert off.ok and on.ok, (off.error, on.error)
    overhead = tracing_overhead(result)
    assert overhead is not None and overhead.runs == 1

    # The bundle: made once, one start from it into an empty cache (every cache a hit), paired with the warm one.
    (bundled,) = result.runs["bundle"]
    assert bundled.ok and bundled.cache_hits()["quantize_weights"] is True, bundled.error
    assert result.bundle is not None and result.bundle.error is None
    assert result.bundle.size > result.bundle.model_bytes
    figures = bundle_figures(result)
    ratio = bundled.phases["actual_total_time"] / warm.phases["actual_total_time"]
    assert figures["ratio_worst"] == pytest.approx(ratio, abs=1e-3)
    # The ETAs: the first cold start from the start-up model alone, the warm start predicted from the cold one, the
    # bundle start and the cold start after a warm one each from a start of their own kind.
    etas = {f["kind"]: f for f in eta_figures(result)}
    assert set(etas) == {
        "cold (first start of the model)",
        "warm after cold",
        "from a bundle into an empty cache",
        "cold after warm (cache emptied)",
    }
    for f in etas.values():
        assert f["eta_s"] is not None and f["error"] == pytest.approx(f["eta_s"] / f["actual_s"] - 1, abs=1e-3)

    md = render_markdown(result, ["bench", "startup", "--runs", "1"])
    assert_no_blank_or_nan(md)
    assert "| quantize_weights | 0 of 1 | 1 of 1 | 1 of 1 |" in md
    assert "## Start from a bundle" in md and "## First ETA" in md
    assert "## Tracing overhead" in md and "Never add an aggregate" in md
    write_reports(result)
    data = json.loads((tmp_path / "out" / "startup.json").read_text())
    assert [r["mode"] for r in data["runs"]] == ["cold", "warm", "bundle", "cold_after_warm", "otlp_off", "otlp_on"]
    assert data["bundle"]["ratio_worst"] == figures["ratio_worst"]
    assert data["tracing_overhead"]["runs"] == 1
    # One JSON per report: every start's own report is in startup.json, none is left beside it.
    assert [r["report"]["phases"] for r in data["runs"]][:2] == [cold.phases, warm.phases]
    assert not [p.name for p in (tmp_path / "out").glob("*-*.json")]
    assert (tmp_path / "out" / "startup_phases.png").read_bytes()[:4] == b"\x89PNG"


def test_default_out_dir_is_under_the_cwd() -> None:
    assert not StartupBenchConfig().out_dir.is_absolute()
    assert StartupBenchConfig().out_dir.parts[0] == "bench-startup"


def test_paired_interval_brackets_the_median_and_narrows_with_pairs() -> None:
    from glowplug.profiling.bench.startup_bench import paired_median_ci

    assert paired_median_ci([0.01, 0.02]) is None  # two pairs: nothing to resample
    assert paired_median_ci([0.03] * 5) == (0.03, 0.03)
    import random

    rng = random.Random(0)
    few = [0.02 + rng.gauss(0, 0.05) for _ in range(5)]
    many = [0.02 + rng.gauss(0, 0.05) for _ in range(200)]
    lo_few, hi_few = paired_median_ci(few)  # type: ignore[misc]
    lo, hi = paired_median_ci(many)  # type: ignore[misc]
    assert lo_few <= sorted(few)[2] <= hi_few
    assert lo < 0.02 < hi and hi - lo < hi_few - lo_few


def test_bundle_flags_are_checked_before_any_run(tmp_path: Path) -> None:
    """A level GLOWPLUG_MAX_CPU_ISA does not take, or a --compare-to that is not a file, fails at once, not after
    the starts."""
    from typing import get_args

    from pydantic import ValidationError

    from glowplug.base.machine import ISA_LEVELS
    from glowplug.profiling.bench.startup_bench import IsaLevel

    assert get_args(IsaLevel) == ISA_LEVELS
    with pytest.raises(ValidationError, match="avx2"):
        StartupBenchConfig(bundle_isa_cap="avx3")
    with pytest.raises(ValidationError, match="is not a file"):
        StartupBenchConfig(compare_to=tmp_path / "missing.json")
    with pytest.raises(ValidationError, match="neither a startup.json nor a folder"):
        StartupBenchConfig(from_runs=tmp_path)  # an empty folder: nothing to render
