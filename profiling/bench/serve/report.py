"""Rendering the sweep: the Markdown tables (vLLM serving-benchmark vocabulary), the JSON and the latency-vs-load PNG.

Every cell is the median over runs with the min-max spread; a figure no run produced says why instead of a blank.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from glowplug.profiling.bench.stats import PERCENTILE_METHOD
from glowplug.profiling.bench.tables import Cell, Missing, fmt_num, markdown_table

from .config import ServeBenchConfig
from .results import LoadPoint, Spread


def write_mode_report(cfg: ServeBenchConfig, out: Path, name: str, text: str, fields: dict[str, Any]) -> list[Path]:
    """A checked mode's report in `out`: `name`.md (the text, also printed) and `name`.json (the config, then the
    result's `fields`); the files written."""
    from glowplug.profiling.bench.cli_support import write_json

    md, js = out / f"{name}.md", out / f"{name}.json"
    md.write_text(text)
    write_json(js, {"config": cfg.model_dump(mode="json"), **fields})
    print(text)
    return [md, js]


def spread_cell(s: Spread | None, digits: int = 1, why: str = "no completed request") -> Cell:
    if s is None:
        return Missing(why)
    if s.runs == 1:  # one run has no measured spread: say so rather than print a bare figure that looks like a median
        return f"{fmt_num(s.median, digits)} (n=1)"
    return f"{fmt_num(s.median, digits)} ({fmt_num(s.min, digits)}–{fmt_num(s.max, digits)})"


def _errors(point: LoadPoint) -> str:
    errs = point.errors()
    return ", ".join(f"{k}: {v}" for k, v in errs.items()) if errs else "0"


def throughput_table(points: Sequence[LoadPoint], slo_given: bool) -> str:
    head = ["Load", "Runs", "Completed", "Failed (by type)", "Requests/s", "Output tok/s", "Total tok/s"]
    if slo_given:
        head.append("Goodput (req/s)")
    rows: list[list[Cell]] = []
    for p in points:
        row: list[Cell] = [
            p.label,
            len(p.runs),
            sum(r.completed for r in p.runs),
            _errors(p),
            spread_cell(p.spread("request_throughput"), 2),
            spread_cell(p.spread("output_throughput"), 1),
            spread_cell(p.spread("total_token_throughput"), 1),
        ]
        if slo_given:
            row.append(spread_cell(p.spread("goodput"), 2))
        rows.append(row)
    return markdown_table(head, rows)


def latency_table(points: Sequence[LoadPoint], metric: str) -> str:
    head = ["Load", "Mean", "p50", "p90", "p99"]
    rows: list[list[Cell]] = []
    for p in points:
        why = "fewer than 2 output tokens" if metric in ("tpot", "itl") else "no completed request"
        rows.append([p.label, *(spread_cell(p.spread(f"{metric}_{s}"), 1, why) for s in ("mean", "p50", "p90", "p99"))])
    return markdown_table(head, rows)


LATENCY_TITLES = {
    "ttft": "Time to first token (ms)",
    "tpot": "Time per output token (ms, excl. the first)",
    "itl": "Inter-token latency (ms)",
    "e2e": "End-to-end latency (ms)",
}


def workload_lines(
    cfg: ServeBenchConfig, lengths: dict[str, float], model: str, base_url: str, started: bool
) -> list[str]:
    source = f"`{cfg.dataset}`" if cfg.dataset else f"synthetic ({cfg.len_distribution}"
    if cfg.dataset is None:
        source += f", ±{cfg.range_ratio:g})" if cfg.len_distribution == "uniform" else ")"
    server = "started by the benchmark (`python -m glowplug.lifecycle`)" if started else f"`{base_url}`"
    slo = []
    if cfg.slo_ttft_ms is not None:
        slo.append(f"TTFT <= {cfg.slo_ttft_ms:g} ms")
    if cfg.slo_tpot_ms is not None:
        slo.append(f"TPOT <= {cfg.slo_tpot_ms:g} ms")
    return [
        f"- server: {server}, model `{model}`, "
        f"endpoint `/v1/{'chat/completions' if cfg.endpoint == 'chat' else 'completions'}`, "
        f"streaming, temperature {cfg.temperature:g}, ignore_eos {cfg.ignore_eos}",
        f"- prompts: {source}; prompt tokens mean {lengths['prompt_tokens_mean']:.0f} "
        f"(min {lengths['prompt_tokens_min']:.0f}, max {lengths['prompt_tokens_max']:.0f}); output tokens mean "
        f"{lengths['output_tokens_mean']:.0f} (min {lengths['output_tokens_min']:.0f}, "
        f"max {lengths['output_tokens_max']:.0f})",
        f"- engine: max-num-seqs {cfg.max_num_seqs}"
        + (f", max-model-len {cfg.max_model_len}" if cfg.max_model_len else "")
        + ("" if started else " (of the started server; ignored with --base-url)"),
        f"- goodput SLO: {', '.join(slo)}" if slo else "- goodput: no SLO given (--slo-ttft-ms, --slo-tpot-ms)",
        f"- each cell: median over {cfg.runs} run(s) (min–max over runs); percentiles: {PERCENTILE_METHOD}",
        "- TTFT: request sent -> first output chunk; TPOT: (E2E - TTFT) / (output tokens - 1); ITL: gaps between "
        "output chunks; throughput over each run's wall time (first request sent -> last response done)",
    ]


def render_sweep(cfg: ServeBenchConfig, points: Sequence[LoadPoint], head: str, workload: list[str]) -> str:
    parts = [
        head,
        *workload,
        "",
        "## Throughput",
        "",
        throughput_table(points, cfg.slo_ttft_ms is not None or cfg.slo_tpot_ms is not None),
        "",
    ]
    for metric, title in LATENCY_TITLES.items():
        parts += [f"## {title}", "", latency_table(points, metric), ""]
    parts += ["![latency vs load](serve_latency.png)", ""]
    return "\n".join(parts)


def sweep_json(
    cfg: ServeBenchConfig, points: Sequence[LoadPoint], lengths: dict[str, float], model: str
) -> dict[str, Any]:
    return {
        "config": cfg.model_dump(mode="json"),
        "model": model,
        "workload": lengths,
        "percentile_method": PERCENTILE_METHOD,
        "load_points": [p.as_dict() for p in points],
    }


def sweep_plot_panels(
    points: Sequence[LoadPoint],
) -> tuple[dict[str, dict[str, list[tuple[float, float, float, float, str, int]]]], dict[str, str]]:
    """(panels, x label per panel) for the latency-vs-load figure. x is the load the sweep set: the concurrency of a
    closed-loop point, the offered rate of an open-loop one (never the achieved req/s, which folds back once the
    server saturates); the two kinds get separate panels, since they set different variables."""
    kinds = [
        (k, xl)
        for k, xl in (
            ("concurrency", "concurrency (clients in flight, as set)"),
            ("rate", "offered requests/s (as set)"),
        )
        if any(p.kind == k for p in points)
    ]
    panels: dict[str, dict[str, list[tuple[float, float, float, float, str, int]]]] = {}
    xlabels: dict[str, str] = {}
    for kind, xlabel in kinds:
        for metric in ("ttft", "tpot", "e2e"):
            name = LATENCY_TITLES[metric] + (", closed loop" if kind == "concurrency" else ", open loop")
            series: dict[str, list[tuple[float, float, float, float, str, int]]] = {}
            for stat in ("p50", "p99"):
                series[stat] = [
                    (p.value, y.median, y.min, y.max, p.label, y.runs)
                    for p in points
                    if p.kind == kind and (y := p.spread(f"{metric}_{stat}")) is not None
                ]
            panels[name] = series
            xlabels[name] = xlabel
    return panels, xlabels


def plot_sweep(cfg: ServeBenchConfig, points: Sequence[LoadPoint], path: Path) -> Path:
    from glowplug.profiling.bench.plots import plot_latency_vs_load

    panels, xlabels = sweep_plot_panels(points)
    title = (
        f"glowplug serve latency vs load: {cfg.model}, --dtype {cfg.dtype}, --compile {cfg.compile}, "
        f"{cfg.input_len} prompt / {cfg.output_len} output tokens ({cfg.len_distribution})"
    )
    return plot_latency_vs_load(panels, path, xlabel=xlabels, title=title, columns=3)
