"""Summary statistics for benchmark samples: one percentile method, used by every table glowplug prints.

Percentile method: linear interpolation between closest ranks, the method numpy calls "linear" (Hyndman & Fan
type 7, numpy's and Excel's PERCENTILE.INC default). For sorted samples x[0..n-1] and q in [0, 100]:

    h = (n - 1) * q / 100,   lo = floor(h),   p_q = x[lo] + (h - lo) * (x[lo + 1] - x[lo])

With one sample every percentile is that sample. Floating-point rounding could push an interpolated value a hair
past x[lo + 1]; the result is clamped to [x[lo], x[lo + 1]], which makes p_q non-decreasing in q, so every summary
satisfies min <= p50 <= p90 <= p99 <= max (seed 001 printed p90 < p50: its percentiles were taken over unsorted
samples). `std` is the sample standard deviation (n - 1 in the denominator; 0.0 for a single sample).

Pure Python on purpose: the CLI imports this module while building its parser.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

PERCENTILE_METHOD = "linear interpolation between closest ranks (numpy 'linear', Hyndman-Fan type 7)"


class EmptySample(ValueError):
    """Statistics of nothing: the caller has a cell without data and must say why instead."""


def _checked(values: Iterable[float]) -> list[float]:
    data = sorted(float(v) for v in values)
    if not data:
        raise EmptySample("no samples")
    if any(not math.isfinite(v) for v in data):
        # A NaN would sort anywhere and poison every percentile; refuse it rather than print "NaN ms".
        raise ValueError(f"non-finite sample in {data!r}")
    return data


def percentile_sorted(data: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of already sorted, finite, non-empty `data`."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100] (got {q})")
    h = (len(data) - 1) * q / 100.0
    lo = math.floor(h)
    if lo >= len(data) - 1:
        return data[-1]
    a, b = data[lo], data[lo + 1]
    value = a + (h - lo) * (b - a)
    return min(max(value, a), b)


def percentile(values: Iterable[float], q: float) -> float:
    return percentile_sorted(_checked(values), q)


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    std: float
    min: float
    max: float
    p50: float
    p90: float
    p99: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def scaled(self, factor: float) -> Summary:
        """The same summary in other units (seconds -> ms); a positive factor keeps the order of the fields."""
        if factor <= 0:
            raise ValueError("scale by a positive factor only")
        return Summary(self.n, *(getattr(self, f) * factor for f in ("mean", "std", "min", "max", "p50", "p90", "p99")))


def summarize(values: Iterable[float]) -> Summary:
    data = _checked(values)
    n = len(data)
    # fsum keeps the mean exact enough that clamping it into [min, max] only ever corrects the last ulp.
    mean = min(max(math.fsum(data) / n, data[0]), data[-1])
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in data) / (n - 1)) if n > 1 else 0.0
    return Summary(
        n=n,
        mean=mean,
        std=std,
        min=data[0],
        max=data[-1],
        p50=percentile_sorted(data, 50),
        p90=percentile_sorted(data, 90),
        p99=percentile_sorted(data, 99),
    )


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    s = summarize(values)
    return s.mean, s.std
