"""From per-request results to the figures of one run and of one load point (the median over its runs).

Per run: TTFT, TPOT, ITL and E2E summaries (ms; p50/p90/p99 by the one percentile method of stats.py), request and
token throughput over the run's wall time (first request sent -> last response done), goodput (requests per
second that met every SLO given), and failures counted by type. Per load point: each figure's median over the
runs with its min-max spread, so a report never rests on a single run.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from glowplug.profiling.bench.stats import Summary, summarize

from .client import RequestResult

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = ("p50", "p90", "p99")


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1e3 > self.ttft_ms):
            return False
        tpot = r.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


@dataclass
class RunMetrics:
    """One run of one load point."""

    duration_s: float
    sent: int
    completed: int
    failed: int
    errors: dict[str, int]
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    latency_ms: dict[str, Summary | None] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["latency_ms"] = {k: (v.as_dict() if v is not None else None) for k, v in self.latency_ms.items()}
        return out

    def figure(self, name: str) -> float | None:
        """`ttft_p99`, `output_throughput`, ...: one number of this run."""
        if "_" in name and name.split("_", 1)[0] in LATENCY_METRICS:
            metric, stat = name.split("_", 1)
            summary = self.latency_ms.get(metric)
            return None if summary is None else float(getattr(summary, stat))
        value = getattr(self, name)
        return None if value is None else float(value)


def _summary_ms(values: Sequence[float]) -> Summary | None:
    return summarize(v * 1e3 for v in values) if values else None


def run_metrics(results: Sequence[RequestResult], slo: Slo | None = None) -> RunMetrics:
    """Figures of one run; hung-up requests (on purpose) count neither as completed nor as failed."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok and not r.hung_up]
    ends = [r.sent_at + (r.e2e_s or 0.0) for r in results if r.e2e_s is not None]
    start = min((r.sent_at for r in results), default=0.0)
    duration = max(max(ends, default=start) - start, 1e-9)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    output = sum(r.output_tokens or 0 for r in done)
    errors = Counter(r.error or "unknown" for r in failed)
    goodput = None
    if slo is not None and slo.given:
        goodput = sum(1 for r in done if slo.met(r)) / duration
    return RunMetrics(
        duration_s=duration,
        sent=len(results),
        completed=len(done),
        failed=len(failed),
        errors=dict(sorted(errors.items())),
        prompt_tokens=prompt,
        output_tokens=output,
        request_throughput=len(done) / duration,
        output_throughput=output / duration,
        total_token_throughput=(prompt + output) / duration,
        goodput=goodput,
        latency_ms={
            "ttft": _summary_ms([r.ttft_s for r in done if r.ttft_s is not None]),
            "tpot": _summary_ms([t for r in done if (t := r.tpot_s) is not None]),
            "itl": _summary_ms([g for r in done for g in r.itl_s]),
            "e2e": _summary_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        },
    )


@dataclass(frozen=True)
class Spread:
    """A figure over runs: the median, with the smallest and largest run."""

    median: float
    min: float
    max: float
    runs: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), len(values))


FIGURES = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "goodput",
    *(f"{m}_{p}" for m in LATENCY_METRICS for p in ("mean", *PERCENTILES)),
)


@dataclass
class LoadPoint:
    """Every run of one load point: a concurrency (closed loop) or a request rate (open loop)."""

    kind: str  # "concurrency" or "rate"
    value: float
    arrival: str | None
    runs: list[RunMetrics]

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {int(self.value)}"
        return f"{self.value:g} req/s ({self.arrival})"

    def spread(self, figure: str) -> Spread | None:
        values = [v for r in self.runs if (v := r.figure(figure)) is not None]
        return Spread.of(values)

    def errors(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for r in self.runs:
            total.update(r.errors)
        return dict(sorted(total.items()))

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "value": self.value,
            "arrival": self.arrival,
            "label": self.label,
            "figures": {f: (asdict(s) if (s := self.spread(f)) is not None else None) for f in FIGURES},
            "errors": self.errors(),
            "runs": [r.as_dict() for r in self.runs],
        }
