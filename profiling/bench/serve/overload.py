"""Overload: does admission control keep the admitted requests' SLO when clients send far more than the server can do?

1. server A (the default admission): capacity, a request throughput at a closed loop of max-num-seqs clients
   (skipped with --sustainable-rate); sustainable rate = --sustainable-load x capacity
2. --runs calibration runs at the sustainable rate on A, each its own Poisson draw: the admission limit
   (--max-queue-wait) of server B is half the lowest of their TTFT p99s (or the value given). One draw's p99 is
   nearly its largest TTFT and swings several-fold between draws; the verdict's worst pair is the one whose
   baseline drew a calm p99, so the limit is set against the calmest draw seen; B starts (A stays up,
   idle) and is warmed up so it knows its step and prompt costs
3. --runs pairs, back to back: Poisson arrivals at the sustainable rate on A (the baseline), then at
   --overload-factor x that rate on B for as long (the overload), on request sets neither server has seen. Pair
   i's ratio is B's admitted TTFT p99 over A's TTFT p99 of the same pair, so both halves of a pair see the same
   machine state.
Pass: the overloaded server answered some requests 429, every 429 carried Retry-After, nothing else failed, and the
worst pair's ratio is within 2x. With --base-url both phases of each pair go to that one server, with whatever
admission limit it was started with.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ServeBenchConfig
from .results import LoadPoint, RunMetrics
from .server import served_model
from .sweep import bodies_for, concurrency_point, rate_run, send_closed
from .workload import build_requests

TTFT_RATIO_LIMIT = 2.0
# Request sets: the capacity runs send seeds 0.., the calibration runs 30_000.., the pairs 40_000.. (both servers the
# same set, each seeing it for the first time). A set a server has seen before finds its prompts in the prefix
# cache: pairs that reused the capacity runs' seeds measured server A's baselines on cached prompts.
_CALIBRATION_SEED = 30_000
_PAIR_SEED = 40_000
_ONE_SERVER_SEED = 50_000  # the overload halves' sets when both halves go to one server (--base-url)


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
    calibration_p99_ms: list[float] = field(default_factory=list)  # the runs that set admission_limit_s

    @property
    def pair_ratios(self) -> list[float]:
        """Per pair: the admitted requests' TTFT p99 under overload / the TTFT p99 of the baseline run just before.
        A run with no completed request has no p99; its pair is NaN, which fails the verdict rather than vanish."""
        out = []
        for b, o in zip(self.baseline.runs, self.overload.runs, strict=True):
            num, den = o.figure("ttft_p99"), b.figure("ttft_p99")
            out.append(num / den if num is not None and den else float("nan"))
        return out

    @property
    def ttft_ratio(self) -> float:
        """The median of the per-pair ratios."""
        finite = [r for r in self.pair_ratios if r == r]  # a pair without a value has no place in a median
        return statistics.median(finite) if finite else float("nan")

    @property
    def worst_ratio(self) -> float:
        """The largest per-pair ratio (NaN when any pair has none: NaN compares false and fails the verdict)."""
        ratios = self.pair_ratios
        return float("nan") if not ratios or any(r != r for r in ratios) else max(ratios)

    @property
    def passed(self) -> bool:
        return (
            self.rejected > 0
            and self.rejected_without_retry_after == 0
            and not self.other_errors
            and self.worst_ratio <= TTFT_RATIO_LIMIT
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "capacity_rps": self.capacity_rps,
            "sustainable_rps": self.sustainable_rps,
            "overload_rps": self.overload_rps,
            "admission_limit_s": self.admission_limit_s,
            "calibration_p99_ms": self.calibration_p99_ms,
            # JSON has no NaN: a pair without a value is null
            "pair_ratios": [r if r == r else None for r in self.pair_ratios],
            "ttft_ratio_median": self.ttft_ratio if self.ttft_ratio == self.ttft_ratio else None,
            "ttft_ratio_worst": self.worst_ratio if self.worst_ratio == self.worst_ratio else None,
            "ttft_ratio_limit": TTFT_RATIO_LIMIT,
            "rejected_429": self.rejected,
            "rejected_without_retry_after": self.rejected_without_retry_after,
            "other_errors": self.other_errors,
            "passed": self.passed,
            "baseline": self.baseline.as_dict(),
            "overload": self.overload.as_dict(),
        }


def _warm_admission(cfg: ServeBenchConfig, base_url: str, tokenizer: Any, model: str) -> None:
    # The server measures its decode step and prompt costs, which its expected-wait admission needs.
    warm = build_requests(cfg, tokenizer, cfg.max_num_seqs, seed=20_000)
    send_closed(cfg, base_url, bodies_for(cfg, warm, model), cfg.max_num_seqs)


def _pairs(
    cfg: ServeBenchConfig,
    tokenizer: Any,
    model: str,
    base_a: str,
    base_b: str,
    sustainable: float,
    say: Callable[[str], None],
) -> tuple[LoadPoint, LoadPoint, list[Any]]:
    rate = sustainable * cfg.overload_factor
    count = round(cfg.num_prompts * cfg.overload_factor)  # the same duration as the baseline
    base_runs, over_runs, raw = [], [], []
    for i in range(cfg.runs):
        say(
            f"overload: pair {i + 1}/{cfg.runs}: {sustainable:.3g} req/s ({cfg.num_prompts} requests), then "
            f"{rate:.3g} req/s ({count} requests)"
        )
        seed = _PAIR_SEED + i
        base_runs.append(rate_run(cfg, base_a, tokenizer, model, sustainable, cfg.num_prompts, seed)[0])
        over_seed = seed if base_b != base_a else _ONE_SERVER_SEED + i  # --base-url: one server sees both halves
        metrics, results = rate_run(cfg, base_b, tokenizer, model, rate, count, over_seed)
        over_runs.append(metrics)
        raw += results
    return (
        LoadPoint("rate", sustainable, cfg.arrival, base_runs),
        LoadPoint("rate", rate, cfg.arrival, over_runs),
        raw,
    )


def run_overload(cfg: ServeBenchConfig, tokenizer: Any, server_for: Any, say: Callable[[str], None]) -> OverloadResult:
    capacity: float | None = None
    limit: float | None = None
    calibration: list[float] = []
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
        if cfg.base_url is not None:  # someone else's server: both phases of each pair on it, as it is configured
            _warm_admission(cfg, base_url, tokenizer, model)
            baseline, overload, raw = _pairs(cfg, tokenizer, model, base_url, base_url, sustainable, say)
        else:
            limit = cfg.max_queue_wait
            if limit is None:
                for k in range(cfg.runs):
                    say(f"overload: calibration run {k + 1}/{cfg.runs} at {sustainable:.3g} req/s (sets the limit)")
                    seed = _CALIBRATION_SEED + k
                    calib, _ = rate_run(cfg, base_url, tokenizer, model, sustainable, cfg.num_prompts, seed)
                    p99 = calib.figure("ttft_p99")
                    if p99:
                        calibration.append(p99)
                # Half the calmest baseline p99: the other half is left for the prefill and the error of the wait
                # estimate.
                limit = min(calibration) / 2e3 if calibration else None
            overrides = {"max_queue_wait": limit} if limit is not None else {}
            say(f"overload: starting server B with --max-queue-wait {limit} (server A stays up, idle)")
            with server_for(cfg, **overrides) as (base_b, _pid_b):
                _warm_admission(cfg, base_b, tokenizer, model)
                baseline, overload, raw = _pairs(cfg, tokenizer, model, base_url, base_b, sustainable, say)
    rejected = [r for r in raw if r.error == "http_429"]
    other: dict[str, int] = {}
    for r in raw:
        if not r.ok and r.error != "http_429":
            other[r.error or "unknown"] = other.get(r.error or "unknown", 0) + 1
    return OverloadResult(
        capacity_rps=capacity,
        sustainable_rps=sustainable,
        overload_rps=sustainable * cfg.overload_factor,
        admission_limit_s=limit,
        calibration_p99_ms=calibration,
        baseline=baseline,
        overload=overload,
        rejected=len(rejected),
        rejected_without_retry_after=sum(1 for r in rejected if not r.retry_after),
        other_errors=other,
    )


def render_overload(r: OverloadResult, head: str) -> str:
    from glowplug.profiling.bench.tables import fmt_num, markdown_table

    from .report import spread_cell

    def row(name: str, p: LoadPoint, rate: float) -> list[Any]:
        return [
            name,
            f"{rate:.3g}",
            sum(x.sent for x in p.runs),
            sum(x.completed for x in p.runs),
            ", ".join(f"{k}: {v}" for k, v in p.errors().items()) or "0",
            *(spread_cell(p.spread(f"ttft_{s}"), 1) for s in ("p50", "p90", "p99")),
            spread_cell(p.spread("tpot_p99"), 1),
            spread_cell(p.spread("output_throughput"), 1),
        ]

    def p99(m: RunMetrics) -> str:
        v = m.figure("ttft_p99")
        return fmt_num(v, 1) if v is not None else "no completed request"

    cap = f"{r.capacity_rps:.3g} req/s" if r.capacity_rps is not None else "not measured (--sustainable-rate given)"
    limit = f"{r.admission_limit_s:.3f} s" if r.admission_limit_s is not None else "the running server's own"
    calib = (
        " = half the lowest TTFT p99 of "
        + f"{len(r.calibration_p99_ms)} calibration runs at the sustainable rate on server A, each its own Poisson "
        + f"draw ({', '.join(f'{v:.1f}' for v in r.calibration_p99_ms)} ms)"
        if r.calibration_p99_ms
        else ""
    )
    rows = [row("sustainable", r.baseline, r.sustainable_rps), row("overload (admitted)", r.overload, r.overload_rps)]

    def ratio(x: float) -> str:
        return fmt_num(x, 2) if x == x else "no value (a run completed no request)"

    pair_rows = [
        [i + 1, p99(b), p99(o), o.errors.get("http_429", 0), ratio(x)]
        for i, (b, o, x) in enumerate(zip(r.baseline.runs, r.overload.runs, r.pair_ratios))
    ]
    n = len(r.pair_ratios)
    return "\n".join(
        [
            head,
            f"- capacity: {cap}; sustainable rate {r.sustainable_rps:.3g} req/s; overload {r.overload_rps:.3g} req/s",
            f"- admission limit (--max-queue-wait): {limit}{calib}",
            f"- 429 answers: {r.rejected} ({r.rejected_without_retry_after} without Retry-After); other failures: "
            f"{r.other_errors or 0}",
            f"- **p99 TTFT of admitted requests / p99 TTFT at the sustainable rate, paired by run (n = {n}): median "
            f"{ratio(r.ttft_ratio)}, worst pair {ratio(r.worst_ratio)}** (limit {TTFT_RATIO_LIMIT} on the worst pair): "
            f"**{'PASS' if r.passed else 'FAIL'}**",
            "",
            "## Pairs",
            "",
            markdown_table(
                ["Pair", "Sustainable TTFT p99 (ms)", "Overload, admitted TTFT p99 (ms)", "429s", "Ratio"], pair_rows
            ),
            "",
            "Pair i: the sustainable-rate run on the server with the default admission, then, right after it, the "
            "overload run on the server with the admission limit; ratio = the second's TTFT p99 (admitted requests) / "
            "the first's. The verdict needs every 429 with Retry-After, no other failure, and the worst (largest) "
            f"ratio <= {TTFT_RATIO_LIMIT:g}.",
            "",
            "## Phases",
            "",
            markdown_table(
                [
                    "Phase",
                    "Offered req/s",
                    "Sent",
                    "Completed",
                    "Failed (by type)",
                    "TTFT p50 (ms)",
                    "TTFT p90 (ms)",
                    "TTFT p99 (ms)",
                    "TPOT p99 (ms)",
                    "Output tok/s",
                ],
                rows,
            ),
            "",
            f"Each cell: median over the {n} runs (min–max). TTFT: request sent -> first output chunk, "
            "percentiles over "
            "one run's completed requests; TPOT: (E2E - TTFT) / (output tokens - 1); output tok/s over the run's wall "
            "time. Sent and Completed are totals over runs.",
            "",
            "![TTFT p99 per pair and the paired ratios against the limit](overload.png)",
            "",
        ]
    )


def plot_overload(r: OverloadResult, cfg: ServeBenchConfig, path: Path) -> Path:
    from glowplug.profiling.bench.plots import plot_overload_pairs

    def p99s(p: LoadPoint) -> list[float | None]:
        return [m.figure("ttft_p99") for m in p.runs]

    title = (
        f"glowplug under overload: {cfg.model}, --dtype {cfg.dtype}, {cfg.input_len} prompt / {cfg.output_len} "
        f"output tokens; sustainable {r.sustainable_rps:.3g} req/s, overload {r.overload_rps:.3g} req/s "
        f"({cfg.overload_factor:g}x)"
    )
    return plot_overload_pairs(
        {"sustainable rate": p99s(r.baseline), "overload, admitted": p99s(r.overload)},
        r.pair_ratios,
        path,
        limit=TTFT_RATIO_LIMIT,
        title=title,
        verdict="PASS" if r.passed else "FAIL",
    )


def overload_mode(
    cfg: ServeBenchConfig, tokenizer: Any, argv: list[str] | None, say: Callable[[str], None], server_for: Any
) -> tuple[bool, list[Path]]:
    from glowplug.profiling.bench.cli_support import prepare_out_dir
    from glowplug.profiling.bench.machine import report_header

    from .report import write_mode_report

    out = prepare_out_dir(cfg.out_dir)
    result = run_overload(cfg, tokenizer, server_for, say)
    text = render_overload(result, report_header("Serving under overload: admission control", argv))
    written = write_mode_report(cfg, out, "overload", text, result.as_dict())
    if cfg.plots:
        written.append(plot_overload(result, cfg, out / "overload.png"))
    return result.passed, written
