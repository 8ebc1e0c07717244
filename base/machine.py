"""Facts about the machine every layer may ask for: the CPU's model name and feature flags, and the streaming-read
bandwidth probe (the decode step's memory ceiling and the start-up floor's read rate). Nothing here imports torch
at import time, so the CLI can check settings against the machine before the heavy imports."""

from __future__ import annotations

import platform
import time
from pathlib import Path

PROBE_BYTES = 1 << 30
PROBE_REPEATS = 5


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (a cache factor and a report header), else what Python knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 or AMX): what makes bf16 the fast dtype on a CPU."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def measure_probe(repeats: int = PROBE_REPEATS, size_bytes: int = PROBE_BYTES) -> float:
    """Streaming-read bandwidth in GB/s: the fastest of `repeats` torch sums over `size_bytes` of fp32 (far larger
    than the caches), with torch's own threads: the decode step's memory ceiling."""
    import torch

    buf = torch.ones(size_bytes // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = max(best, size_bytes / (time.perf_counter() - t0) / 1e9)
    return best
