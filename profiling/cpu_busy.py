"""How busy the other processes keep this process's cores now: the CPU contention a start meets.

Why not the load average: it is a one-minute exponential average, so right after a compile-heavy process exits (the
previous start, a test run) it still reports that process for a minute, and a start planned then is predicted
slower than it runs. Here the machine's busy CPU time (`/proc/stat`, the usable cores only) is sampled at the
process's entry (`mark_entry`, called by `profiling/process.py mark_main_entry`) and again when asked; what this
process itself used in between (`os.times`, all its threads) is taken out, and the rest is the other processes'
use over that window.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# A window shorter than this holds too few clock ticks (10 ms each) to tell one busy core from none.
MIN_WINDOW_S = 0.25
# /proc/stat per-CPU columns after the name: user nice system idle iowait irq softirq steal guest guest_nice.
# Busy = all but idle and iowait; guest time is already inside user and nice.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class CpuSample:
    """Busy CPU-seconds of the usable cores since boot, this process's CPU-seconds, and when (monotonic)."""

    busy_s: float
    own_s: float
    at_s: float
    cores: int


_entry: CpuSample | None = None


def usable_cores() -> set[int]:
    """The CPU numbers this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def sample() -> CpuSample | None:
    """Read the counters now; None where the system has no /proc/stat."""
    cores = usable_cores()
    busy_ticks = 0
    seen = 0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *cols = line.split()
                if int(name[3:]) not in cores:
                    continue
                busy_ticks += sum(int(cols[i]) for i in _BUSY_COLUMNS if i < len(cols))
                seen += 1
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    if not seen:
        return None
    t = os.times()
    return CpuSample(busy_ticks / hz, t.user + t.system, time.monotonic(), seen)


def mark_entry() -> None:
    """Take the entry sample (the first call wins): call at the first line of the process's own code."""
    global _entry
    if _entry is None:
        _entry = sample()


def others_cores(since: CpuSample | None = None) -> float | None:
    """Cores the other processes kept busy on average since `since` (default: the entry sample); None without a
    sample, or when the window is shorter than MIN_WINDOW_S."""
    start = since or _entry
    now = sample()
    if start is None or now is None or now.at_s - start.at_s < MIN_WINDOW_S:
        return None
    others = (now.busy_s - start.busy_s) - (now.own_s - start.own_s)
    return max(0.0, others) / (now.at_s - start.at_s)


def run_queue_per_core(since: CpuSample | None = None) -> float | None:
    """(the other processes' busy cores + this process's one) / usable cores: the load average's measure, taken
    over the window since `since` instead of the last minute. None as for `others_cores`."""
    others = others_cores(since)
    if others is None:
        return None
    return (others + 1.0) / max(1, len(usable_cores()))
