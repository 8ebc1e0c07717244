"""What the live page charts once a second while serving: requests running and waiting, KV-cache usage, tokens/s,
and TTFT / TPOT percentiles over the last minute.

Counts and gauges are read from the service's own Prometheus metrics (`ServiceMetrics.current()`), so the page and
`/metrics` show the same numbers. Percentiles are exact over a sliding window of recent requests
(`RecentRequests`, fed by `ServiceMetrics.observe_request`): the Prometheus histograms keep only bucket counts,
whose interpolated quantiles can be off by a whole bucket (0.25 s -> 0.5 s), too coarse to read off a chart.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PERCENTILES = (50, 90, 99)
WINDOW_S = 60.0


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on an already sorted sequence."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class RecentRequests:
    """TTFT and TPOT of the requests that finished in the last `window_s` seconds. Thread-safe."""

    def __init__(
        self, window_s: float = WINDOW_S, max_items: int = 50_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._items: deque[tuple[float, float | None, float | None]] = deque(maxlen=max_items)

    def add(self, ttft_s: float | None, tpot_s: float | None) -> None:
        with self._lock:
            self._items.append((self._clock(), ttft_s, tpot_s))

    def summary(self) -> dict[str, Any]:
        """{"ttft": {"p50", "p90", "p99", "n"}, "tpot": {...}, "window_s"}; percentiles None with no data."""
        now = self._clock()
        with self._lock:
            while self._items and self._items[0][0] < now - self.window_s:
                self._items.popleft()
            items = list(self._items)
        out: dict[str, Any] = {"window_s": self.window_s}
        for key, index in (("ttft", 1), ("tpot", 2)):
            values = sorted(v for item in items if (v := item[index]) is not None)
            stats: dict[str, Any] = {f"p{q}": (percentile(values, q) if values else None) for q in PERCENTILES}
            stats["n"] = len(values)
            out[key] = stats
        return out


class ServingSampler:
    """One sample per call: the current gauges plus token rates since the previous call."""

    def __init__(
        self,
        current: Callable[[], Mapping[str, float]],
        recent: RecentRequests,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._current = current
        self._recent = recent
        self._clock = clock
        self._last: tuple[float, float, float] | None = None  # (time, generation tokens, prompt tokens)

    def sample(self) -> dict[str, Any]:
        now = self._clock()
        values = self._current()
        gen, prompt = values["generation_tokens"], values["prompt_tokens"]
        tokens_per_s = prompt_per_s = 0.0
        if self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            # A counter never goes down; max() keeps a (theoretical) reset from showing a negative rate.
            tokens_per_s = max(0.0, gen - self._last[1]) / dt
            prompt_per_s = max(0.0, prompt - self._last[2]) / dt
        self._last = (now, gen, prompt)
        return {
            "running": int(values["running"]),
            "waiting": int(values["waiting"]),
            "kv_usage": values["kv_usage"],
            "kv_used_blocks": int(values["kv_used_blocks"]),
            "kv_total_blocks": int(values["kv_total_blocks"]),
            "tokens_per_s": tokens_per_s,
            "prompt_tokens_per_s": prompt_per_s,
            **self._recent.summary(),
        }
