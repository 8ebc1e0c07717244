"""The header every report opens with: the exact command, the machine, the versions and the date."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from pathlib import Path

import psutil

from ...base.machine import PROBE_BYTES, PROBE_REPEATS, cpu_model, measure_probe
from ..phases import current_versions

__all__ = ["PROBE_BYTES", "PROBE_REPEATS", "command_line", "cpu_model", "machine_summary", "measure_probe",
           "report_header"]


def machine_summary() -> str:
    mem = psutil.virtual_memory().total / 2**30
    return f"{cpu_model()}, {os.cpu_count()} cores, {mem:.1f} GiB RAM, {platform.system()} {platform.release()}"


# Settings from the environment that change what a benchmark measures: the ISA caps (glowplug's, torch's, oneDNN's).
# A report's command line starts with the ones set, so that it reproduces the run.
REPORTED_ENV: tuple[str, ...] = ("GLOWPLUG_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def command_line(argv: list[str] | None = None) -> str:
    args = sys.argv[1:] if argv is None else argv
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in REPORTED_ENV if os.environ.get(k)]
    return " ".join([*env, "glowplug", *(shlex.quote(a) for a in args)])


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
