"""One `glowplug startup` in a fresh Python process, and its JSON phase report read back.

A start-up is only honest in a new process: imports, the allocator and every in-process cache start empty, and the
process_start / imports rows exist only there. The cache directory is the other half of "cold" vs "warm": an empty
`GLOWPLUG_CACHE_DIR` misses the model conversion, the compile cache and the KV-profile cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glowplug.profiling.names import Attr

CACHE_ENV = "GLOWPLUG_CACHE_DIR"
KV_ROW = "kv_cache_profiling"  # the row whose span carries the KV plan's attributes
READY_ROW = "actual_total_time"


@dataclass
class StartupRun:
    label: str
    returncode: int
    wall_s: float  # the subprocess as the parent saw it (includes interpreter exit after READY)
    report: dict[str, Any] = field(default_factory=dict)  # the --report-out JSON (see profiling/phases.py to_dict)
    error: str | None = None  # why the start failed, from the child's stderr
    # `glowplug startup --predict-only` run right before this start, in the same cache dir (bench startup
    # --predict): its JSON, or {"error": why} when it could not predict.
    prediction: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None

    @property
    def phases(self) -> dict[str, float | None]:
        return dict(self.report.get("phases", {}))

    @property
    def reasons(self) -> dict[str, str]:
        return dict(self.report.get("reasons", {}))

    def attr(self, row: str, key: str) -> Any:
        return self.report.get("attributes", {}).get(row, {}).get(key)

    def cache_hits(self) -> dict[str, bool]:
        """Row -> whether that phase's cache hit, for every row that reports a cache."""
        out = {}
        for row, attrs in self.report.get("attributes", {}).items():
            if Attr.CACHE_HIT in attrs:
                out[row] = bool(attrs[Attr.CACHE_HIT])
        return out


def failure_reason(stderr: str, returncode: int) -> str:
    """The child's own explanation (its `glowplug: ...` lines), else the tail of its stderr."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("glowplug:")), None)
    picked = lines[start:] if start is not None else lines[-3:]
    text = " ".join(picked).removeprefix("glowplug: ").removeprefix("state FAILED: ")
    return text or f"exit status {returncode} and nothing on stderr"


def run_startup(
    label: str,
    startup_args: list[str],
    report_path: Path,
    *,
    cache_dir: Path | None = None,
    timeout_s: float = 900.0,
    env: Mapping[str, str] | None = None,
) -> StartupRun:
    """`python -m glowplug.cli startup <startup_args> --report-out report_path` with GLOWPLUG_CACHE_DIR=cache_dir."""
    import json

    child_env = dict(os.environ if env is None else env)
    if cache_dir is not None:
        child_env[CACHE_ENV] = str(cache_dir)
    report_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "glowplug.cli", "startup", *startup_args, "--report-out", str(report_path)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return StartupRun(label, -1, time.perf_counter() - t0, error=f"timed out after {timeout_s:g} s")
    wall = time.perf_counter() - t0
    report: dict[str, Any] = {}
    if report_path.is_file():
        # Written even when a stage fails: the table shows how far the start got.
        report = json.loads(report_path.read_text())
    error = None if proc.returncode == 0 else failure_reason(proc.stderr, proc.returncode)
    if error is None and not report:
        error = "no report written"
    return StartupRun(label, proc.returncode, wall, report, error)


def run_prediction(
    startup_args: list[str],
    report_path: Path,
    *,
    cache_dir: Path | None = None,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """`glowplug startup <startup_args> --predict-only --report-out report_path`: the prediction a start would get
    before it starts, with the command's own wall time (`command_s`); {"error": why} when there is none."""
    import json

    child_env = dict(os.environ if env is None else env)
    if cache_dir is not None:
        child_env[CACHE_ENV] = str(cache_dir)
    report_path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "glowplug.cli",
        "startup",
        *startup_args,
        "--predict-only",
        "--report-out",
        str(report_path),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"--predict-only timed out after {timeout_s:g} s"}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not report_path.is_file():
        return {"error": failure_reason(proc.stderr, proc.returncode), "command_s": wall}
    return {**json.loads(report_path.read_text()), "command_s": wall}


def short(reason: str, limit: int = 110) -> str:
    """A reason short enough for a table cell (the full text goes under the table)."""
    reason = " ".join(reason.split())
    return reason if len(reason) <= limit else reason[: limit - 1].rstrip() + "…"
