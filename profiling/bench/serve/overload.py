"""Overload: does admission control keep the admitted requests' SLO when clients send far more than the server can do?

1. capacity: request throughput at a closed loop of max-num-seqs clients (skipped with --sustainable-rate)
2. sustainable rate = --sustainable-load x capacity; Poisson arrivals at that rate give the baseline TTFT p99
3. a server whose admission limit (--max-queue-wait) is half that baseline p99 (or the value given), warmed up so it
   knows its finish rate, then Poisson arrivals at --overload-factor x the sustainable rate for as long as the
   baseline ran
Pass: the overloaded server answered some requests 429, every 429 carried Retry-After, nothing else failed, and the
p99 TTFT of the admitted requests stayed within 2x of the baseline p99. With --base-url the same server serves
both phases with whatever admission limit it was started with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ServeBenchConfig
from .load import api_path, run_closed
from .results import LoadPoint
from .server import served_model
from .sweep import bodies_for, concurrency_point, rate_point
from .workload import build_requests

TTFT_RATIO_LIMIT = 2.0


@dataclass
class OverloadResult:
    capacity_rps: float | None
    sustainable_rps: float
    overload_rps: float
    admission_limit_s: float | None
    baseline: LoadPoint
    overload: LoadPoint
    rejected: int
    rejected_without_retry_after: int
    other_errors: dict[str, int]

    @property
    def baseline_p99(self) -> float:
        s = self.baseline.spread("ttft_p99")
        return s.median if s is not None else float("nan")

    @property
    def admitted_p99(self) -> float:
        s = self.overload.spread("ttft_p99")
        return s.median if s is not None else float("nan")

    @property
    def ttft_ratio(self) -> float:
        return self.admitted_p99 / self.baseline_p99

    @property
    def passed(self) -> bool:
        return (
            self.rejected > 0
            and self.rejected_without_retry_after == 0
            and not self.other_errors
            and self.ttft_ratio <= TTFT_RATIO_LIMIT
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "capacity_rps": self.capacity_rps,
            "sustainable_rps": self.sustainable_rps,
            "overload_rps": self.overload_rps,
            "admission_limit_s": self.admission_limit_s,
            "baseline_ttft_p99_ms": self.baseline_p99,
            "admitted_ttft_p99_ms": self.admitted_p99,
            "ttft_ratio": self.ttft_ratio,
            "ttft_ratio_limit": TTFT_RATIO_LIMIT,
            "rejected_429": self.rejected,
            "rejected_without_retry_after": self.rejected_without_retry_after,
            "other_errors": self.other_errors,
            "passed": self.passed,
            "baseline": self.baseline.as_dict(),
            "overload": self.overload.as_dict(),
        }


def run_overload(cfg: ServeBenchConfig, tokenizer: Any, server_for: Any, say: Callable[[str], None]) -> OverloadResult:
    capacity: float | None = None
    limit: float | None = None
    with server_for(cfg) as (base_url, _pid):
        model = cfg.served_model_name or served_model(base_url)
        if cfg.sustainable_rate is None:
            say(f"overload: measuring capacity (closed loop, {cfg.max_num_seqs} clients)")
            point = concurrency_point(cfg, base_url, tokenizer, model, cfg.max_num_seqs, say)
            spread = point.spread("request_throughput")
            if spread is None:
                raise RuntimeError("the capacity run completed no request; see the server's log")
            capacity = spread.median
        sustainable = cfg.sustainable_rate or cfg.sustainable_load * (capacity or 0.0)
        baseline, _ = rate_point(cfg, base_url, tokenizer, model, sustainable, say)
        if cfg.base_url is not None:  # someone else's server: both phases on it, as it is configured
            overload, raw = _overload_phase(cfg, base_url, tokenizer, model, sustainable, say)
    if cfg.base_url is None:
        ttft = baseline.spread("ttft_p99")
        # Half the baseline p99: the other half is left for the prefill and the error of the wait estimate.
        limit = cfg.max_queue_wait if cfg.max_queue_wait is not None else (ttft.median / 2e3 if ttft else None)
        overrides = {"max_queue_wait": limit} if limit is not None else {}
        say(f"overload: restarting the server with --max-queue-wait {limit}")
        with server_for(cfg, **overrides) as (base_url, _pid):
            overload, raw = _overload_phase(cfg, base_url, tokenizer, model, sustainable, say)
    results = [r for run in raw for r in run]
    rejected = [r for r in results if r.error == "http_429"]
    other: dict[str, int] = {}
    for r in results:
        if not r.ok and r.error != "http_429":
            other[r.error or "unknown"] = other.get(r.error or "unknown", 0) + 1
    return OverloadResult(
        capacity_rps=capacity, sustainable_rps=sustainable, overload_rps=sustainable * cfg.overload_factor,
        admission_limit_s=limit, baseline=baseline, overload=overload, rejected=len(rejected),
        rejected_without_retry_after=sum(1 for r in rejected if not r.retry_after), other_errors=other,
    )  # fmt: skip


def _overload_phase(
    cfg: ServeBenchConfig, base_url: str, tokenizer: Any, model: str, sustainable: float, say: Callable[[str], None]
) -> tuple[LoadPoint, list[list[Any]]]:
    # Warm-up: the server learns its finish rate, which its expected-wait admission needs.
    warm = build_requests(cfg, tokenizer, cfg.max_num_seqs, seed=20_000)
    run_closed(base_url, api_path(cfg.endpoint), bodies_for(cfg, warm, model), cfg.max_num_seqs,
               max_duration=cfg.max_duration, timeout=cfg.request_timeout)  # fmt: skip
    rate = sustainable * cfg.overload_factor
    count = round(cfg.num_prompts * cfg.overload_factor)  # the same duration as the baseline
    return rate_point(cfg, base_url, tokenizer, model, rate, say, count=count)


def render_overload(r: OverloadResult, head: str) -> str:
    from ..tables import markdown_table
    from .report import spread_cell

    def row(name: str, p: LoadPoint, rate: float) -> list[Any]:
        return [name, f"{rate:.3g}", sum(x.sent for x in p.runs), sum(x.completed for x in p.runs),
                ", ".join(f"{k}: {v}" for k, v in p.errors().items()) or "0",
                *(spread_cell(p.spread(f"ttft_{s}"), 1) for s in ("p50", "p90", "p99")),
                spread_cell(p.spread("tpot_p99"), 1), spread_cell(p.spread("output_throughput"), 1)]  # fmt: skip

    cap = f"{r.capacity_rps:.3g} req/s" if r.capacity_rps is not None else "not measured (--sustainable-rate given)"
    limit = f"{r.admission_limit_s:.3f} s" if r.admission_limit_s is not None else "the running server's own"
    rows = [row("sustainable", r.baseline, r.sustainable_rps), row("overload (admitted)", r.overload, r.overload_rps)]
    return "\n".join([
        head,
        f"- capacity: {cap}; sustainable rate {r.sustainable_rps:.3g} req/s; overload {r.overload_rps:.3g} req/s",
        f"- admission limit (--max-queue-wait): {limit}",
        f"- 429 answers: {r.rejected} ({r.rejected_without_retry_after} without Retry-After); other failures: "
        f"{r.other_errors or 0}",
        f"- **p99 TTFT of admitted requests / p99 TTFT at the sustainable rate: {r.ttft_ratio:.2f}** "
        f"(limit {TTFT_RATIO_LIMIT}): **{'PASS' if r.passed else 'FAIL'}**",
        "",
        markdown_table(["Phase", "Offered req/s", "Sent", "Completed", "Failed (by type)", "TTFT p50 (ms)",
                        "TTFT p90 (ms)", "TTFT p99 (ms)", "TPOT p99 (ms)", "Output tok/s"], rows),  # fmt: skip
        "",
        "![TTFT at the sustainable rate and under overload](overload.png)",
        "",
    ])  # fmt: skip


def plot_overload(r: OverloadResult, cfg: ServeBenchConfig, path: Path) -> Path:
    from ..plots import plot_latency_vs_load

    panels: dict[str, dict[str, list[tuple[float, float, float, float, str, int]]]] = {}
    for metric, title in (("ttft", "Time to first token (ms)"), ("e2e", "End-to-end latency (ms)")):
        series: dict[str, list[tuple[float, float, float, float, str, int]]] = {}
        for stat in ("p50", "p99"):
            pts = []
            for name, p, rate in (("sustainable", r.baseline, r.sustainable_rps),
                                  ("overload, admitted", r.overload, r.overload_rps)):  # fmt: skip
                s = p.spread(f"{metric}_{stat}")
                if s is not None:
                    pts.append((rate, s.median, s.min, s.max, name, s.runs))
            series[stat] = pts
        panels[title] = series
    head = (f"glowplug under overload: {cfg.model}, --dtype {cfg.dtype}, {cfg.input_len} prompt / {cfg.output_len} "
            f"output tokens, sustainable rate then {cfg.overload_factor:g}x it (admitted requests only)")
    return plot_latency_vs_load(panels, path, xlabel="offered requests/s", title=head)


def overload_mode(
    cfg: ServeBenchConfig, tokenizer: Any, argv: list[str] | None, say: Callable[[str], None], server_for: Any
) -> tuple[bool, list[Path]]:
    from ..cli_support import prepare_out_dir, write_json
    from ..machine import report_header

    out = prepare_out_dir(cfg.out_dir)
    result = run_overload(cfg, tokenizer, server_for, say)
    text = render_overload(result, report_header("Serving under overload: admission control", argv))
    (out / "overload.md").write_text(text)
    write_json(out / "overload.json", {"config": cfg.model_dump(mode="json"), **result.as_dict()})
    written = [out / "overload.md", out / "overload.json"]
    if cfg.plots:
        written.append(plot_overload(result, cfg, out / "overload.png"))
    print(text)
    return result.passed, written
