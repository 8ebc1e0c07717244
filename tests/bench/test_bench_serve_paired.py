"""The serve reports' verdicts and figures, on hand-made data (no server, no model): paired ratios judged on the
worst pair, the fuzz strategy's bound on what a case asks the server to generate, and the latency figure's x axis
being the load that was set (concurrency), not the throughput that came out of it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from glowplug.profiling.bench.serve.results import LoadPoint, RunMetrics
from glowplug.profiling.bench.stats import summarize


def _run(
    ttft_p99_ms: float | None = None, *, request_throughput: float = 1.0, errors: dict[str, int] | None = None
) -> RunMetrics:
    """A run whose TTFT percentiles are all `ttft_p99_ms` (a one-value summary) and whose achieved req/s is given."""
    latency = {"ttft": summarize([ttft_p99_ms]) if ttft_p99_ms is not None else None}
    for metric in ("tpot", "e2e"):
        latency[metric] = summarize([ttft_p99_ms or 1.0])
    return RunMetrics(
        duration_s=1.0,
        sent=4,
        completed=4,
        failed=0,
        errors=errors or {},
        prompt_tokens=4,
        output_tokens=4,
        request_throughput=request_throughput,
        output_throughput=4.0,
        total_token_throughput=8.0,
        goodput=None,
        latency_ms=latency,
    )


def _overload(base: list[float | None], over: list[float | None]) -> Any:
    from glowplug.profiling.bench.serve.overload import OverloadResult

    return OverloadResult(
        capacity_rps=10.0,
        sustainable_rps=8.0,
        overload_rps=32.0,
        admission_limit_s=0.05,
        baseline=LoadPoint("rate", 8.0, "poisson", [_run(b) for b in base]),
        overload=LoadPoint("rate", 32.0, "poisson", [_run(o, errors={"http_429": 5}) for o in over]),
        rejected=15,
        rejected_without_retry_after=0,
        other_errors={},
    )


def test_overload_verdict_reads_the_worst_pair_not_a_ratio_of_medians() -> None:
    # Medians: 100 / 100 = 1.0 (would pass); pairs: 1.0, 0.5, 2.5 -> median 1.0, worst 2.5 > 2.0 -> FAIL.
    r = _overload([100.0, 200.0, 40.0], [100.0, 100.0, 100.0])
    assert r.pair_ratios == pytest.approx([1.0, 0.5, 2.5])
    assert r.ttft_ratio == pytest.approx(1.0) and r.worst_ratio == pytest.approx(2.5)
    assert not r.passed
    ok = _overload([100.0, 90.0, 110.0], [150.0, 170.0, 190.0])
    assert ok.passed and ok.worst_ratio == pytest.approx(170 / 90)
    # A run with no completed request has no p99: its pair is NaN and fails the verdict instead of vanishing.
    empty = _overload([100.0, 100.0, 100.0], [100.0, None, 100.0])
    assert not empty.passed
    # ... and the report still renders and writes strict JSON, naming the pair without a value.
    from glowplug.profiling.bench.serve.overload import render_overload

    text = render_overload(empty, "# head")
    assert "worst pair no value (a run completed no request)" in text and "**FAIL**" in text
    data = json.loads(json.dumps(empty.as_dict(), allow_nan=False))
    assert data["pair_ratios"] == [1.0, None, 1.0] and data["ttft_ratio_worst"] is None
    assert data["ttft_ratio_median"] == pytest.approx(1.0)


def test_overload_report_table_is_recomputed_from_the_runs(tmp_path: Path) -> None:
    from glowplug.profiling.bench.serve.overload import render_overload

    r = _overload([100.0, 200.0, 40.0], [100.0, 100.0, 100.0])
    text = render_overload(r, "# head")
    assert "median 1.00, worst pair 2.50" in text and "**FAIL**" in text
    rows = re.findall(r"^\| (\d) \| ([\d.]+) \| ([\d.]+) \| (\d+) \| ([\d.]+) \|$", text, re.M)
    assert [int(p) for p, *_ in rows] == [1, 2, 3]
    for _pair, base, over, _n429, ratio in rows:
        assert float(ratio) == pytest.approx(float(over) / float(base), abs=0.006)


def test_overload_figure_renders_pairs_and_title_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from glowplug.profiling.bench import plots
    from glowplug.profiling.bench.serve.config import ServeBenchConfig
    from glowplug.profiling.bench.serve.overload import plot_overload

    figs: list[Any] = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figs.append(fig), save(fig, path))[1])
    r = _overload([100.0, 200.0, 40.0], [100.0, 100.0, 100.0])
    path = plot_overload(r, ServeBenchConfig(), tmp_path / "overload.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    fig = figs[0]
    left, right = fig.axes
    # Right panel: one dot per pair at its ratio, and the limit line at 2.0.
    dots = right.collections[0].get_offsets()
    assert list(dots[:, 1]) == pytest.approx(r.pair_ratios)
    assert any(list(line.get_ydata()) == [2.0, 2.0] for line in right.lines)
    # Every text (suptitle, axis labels) lies inside the canvas: nothing clipped.
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for text in [fig._suptitle, left.xaxis.label, left.yaxis.label, right.xaxis.label, right.yaxis.label]:
        ext = text.get_window_extent(renderer)
        assert ext.x0 >= box.x0 - 1 and ext.x1 <= box.x1 + 1 and ext.y0 >= box.y0 - 1 and ext.y1 <= box.y1 + 1


def test_latency_figure_x_is_the_concurrency_set_not_the_throughput(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrency 64 achieving fewer req/s than 32 (a saturated server) must still plot right of 32."""
    from glowplug.profiling.bench import plots
    from glowplug.profiling.bench.serve.config import ServeBenchConfig
    from glowplug.profiling.bench.serve.report import plot_sweep, sweep_plot_panels

    achieved = {1: 0.9, 8: 6.0, 32: 12.0, 64: 10.0}
    points = [
        LoadPoint("concurrency", c, None, [_run(10.0 * c + k, request_throughput=rps) for k in range(3)])
        for c, rps in achieved.items()
    ]
    panels, xlabels = sweep_plot_panels(points)
    for name, series in panels.items():
        assert [p[0] for p in series["p99"]] == [1, 8, 32, 64] and "concurrency" in xlabels[name]
    figs: list[Any] = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figs.append(fig), save(fig, path))[1])
    plot_sweep(ServeBenchConfig(runs=3), points, tmp_path / "serve_latency.png")
    for ax in figs[0].axes:
        assert ax.get_xscale() == "log"  # 1 to 64 spans more than a decade
        assert list(ax.lines[0].get_xdata()) == [1, 8, 32, 64]
        assert "concurrency" in ax.get_xlabel()
    assert "n = 3 runs per point" in figs[0]._suptitle.get_text()


def test_efficiency_render_states_each_pair_and_the_worst() -> None:
    from glowplug.profiling.bench.serve.efficiency import EfficiencyResult, OfflineRun, ServerRun, render_efficiency

    server = [ServerRun(1.0, t, 0, 10, 0.9) for t in (1004, 952, 847)]
    offline = [OfflineRun(1.0, 1000, 10, 1.0) for _ in range(3)]
    r = EfficiencyResult(8, 16, 16, 8, server, offline)
    text = render_efficiency(r, "# head")
    assert "median 0.952, worst pair 0.847" in text and "**FAIL**" in text
    assert "| Server / offline, per pair | 1.004, 0.952, 0.847 |" in text
    # The offline step figures come from each run (n = runs), with a spread, not one extra pass.
    assert re.search(r"\| Mean step \(ms\) \| 90\.0 \(90\.0–90\.0\) \| 100\.0 \(100\.0–100\.0\) \|", text)


def _fuzz_doc() -> dict[str, Any]:
    """The server's own document for the two generation endpoints, refined as the server does, without a server."""
    from glowplug.lifecycle.openapi import _refine_document

    generation = {"/v1/completions": {"post": {}}, "/v1/chat/completions": {"post": {}}}
    doc: dict[str, Any] = {"openapi": "3.1.0", "info": {"title": "glowplug", "version": "0"}, "paths": generation}
    _refine_document(doc, "tiny")
    return doc


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzz_strategy_never_asks_for_more_than_the_bound(path: str) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    from glowplug.profiling.bench.serve.fuzz import FuzzBound, bounded_strategy

    operation = schemathesis.openapi.from_dict(_fuzz_doc())[path]["POST"]
    bound = FuzzBound(max_tokens=8, max_n=2)
    bodies: list[Any] = []
    raw: list[Any] = []

    def collect(into: list[Any], strategy: Any) -> None:
        @settings(
            max_examples=25,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def one(case: Any) -> None:
            into.append(case.body)

        one()

    collect(bodies, bounded_strategy(operation, bound))
    collect(raw, bounded_strategy(operation, None))

    def tokens(b: dict[str, Any]) -> list[float]:
        return [v for k in ("max_tokens", "max_completion_tokens") if isinstance(v := b.get(k), (int, float))]

    # The unbounded strategy does ask for more (or for nothing, i.e. up to max-model-len): the bound is not vacuous.
    assert any(not tokens(b) or max(tokens(b)) > 8 for b in raw if isinstance(b, dict))
    dicts = [b for b in bodies if isinstance(b, dict)]
    assert len(dicts) >= 15
    for b in dicts:
        assert tokens(b) and max(tokens(b)) <= 8, b  # always set, never above the bound
        for key in ("n", "best_of"):
            if isinstance(b.get(key), (int, float)) and not isinstance(b.get(key), bool):
                assert b[key] <= 2, b
        assert all(len(s) <= 64 for s in _strings(b.get("prompt")) + _strings(b.get("messages"))), b


def test_fuzz_bound_on_hand_made_bodies() -> None:
    from glowplug.profiling.bench.serve.fuzz import FuzzBound

    bound = FuzzBound(max_tokens=16, max_n=2)
    assert bound.apply({"prompt": "x"}) == {"prompt": "x", "max_tokens": 16}
    assert bound.apply({"max_tokens": None}) == {"max_tokens": 16}
    assert bound.apply({"max_tokens": 4, "n": 9, "best_of": 9}) == {"max_tokens": 4, "n": 2, "best_of": 2}
    assert bound.apply({"max_completion_tokens": 6.4e7}) == {"max_completion_tokens": 16}
    assert bound.apply({"max_tokens": True}) == {"max_tokens": 16}  # a bool is not a number of tokens
    assert bound.apply([1, 2]) == [1, 2]  # not an object: left for the server to refuse
    cut = FuzzBound(max_tokens=16, max_n=2, max_prompt_chars=3, max_prompt_items=2)
    assert cut.apply({"prompt": ["abcdef", "gh", "ijk"], "max_tokens": 1}) == {"prompt": ["abc", "gh"], "max_tokens": 1}
    body = {"prompt": [[1, 2, 3]], "messages": [{"role": "user", "content": "hello"}], "stop": "long stop"}
    # Only prompt and messages are cut; other strings (stop) keep what hypothesis drew.
    assert cut.apply(body) == {
        "prompt": [[1, 2]],
        "messages": [{"role": "use", "content": "hel"}],
        "stop": "long stop",
        "max_tokens": 16,
    }
