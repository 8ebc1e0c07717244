"""The header every report opens with: the exact command, the machine, the versions and the date."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from pathlib import Path

import psutil

from ..phases import current_versions


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_summary() -> str:
    mem = psutil.virtual_memory().total / 2**30
    return f"{cpu_model()}, {os.cpu_count()} cores, {mem:.1f} GiB RAM, {platform.system()} {platform.release()}"


def command_line(argv: list[str] | None = None) -> str:
    args = sys.argv[1:] if argv is None else argv
    return "glowplug " + " ".join(shlex.quote(a) for a in args)


def report_header(title: str, argv: list[str] | None = None) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in current_versions().items())
    return "\n".join(
        [
            f"# {title}",
            "",
            f"- command: `{command_line(argv)}`",
            f"- machine: {machine_summary()}",
            f"- versions: {versions}",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
        ]
    )


PROBE_BYTES = 1 << 30
PROBE_REPEATS = 5


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
