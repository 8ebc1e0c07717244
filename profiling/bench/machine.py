"""The header every report opens with: the exact command, the machine, the versions and the date."""

from __future__ import annotations

import functools
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from glowplug.base.machine import (
    PROBE_BYTES,
    PROBE_REPEATS,
    ProbeStats,
    cpu_model,
    measure_probe,
    measure_probe_stats,
)
from glowplug.profiling.phases import current_versions

__all__ = [
    "COMMIT_ENV",
    "DIRTY_ENV",
    "PROBE_BYTES",
    "PROBE_REPEATS",
    "ComputePeak",
    "GitState",
    "ProbeStats",
    "command_line",
    "compute_peak",
    "cpu_clock",
    "cpu_model",
    "git_state",
    "gpu_summary",
    "machine_summary",
    "measure_probe",
    "measure_probe_stats",
    "report_git_state",
    "report_header",
]

# Set by `glowplug bench all` on every report process it starts: the commit and dirty state it measured once, at the
# start of the run, so that every report of one run names the same code (a report cannot tell by itself whether an
# earlier chunk rewrote a committed report, and the tree may change while a long run goes on).
COMMIT_ENV = "GLOWPLUG_BENCH_COMMIT"
DIRTY_ENV = "GLOWPLUG_BENCH_DIRTY"
_HEX40 = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class GitState:
    """The code a report was made with: HEAD (40 hex digits) and whether tracked files differ from it."""

    commit: str | None  # None: not measurable; `error` says why
    dirty: bool
    error: str | None = None

    def describe(self) -> str:
        """The full commit, flagged when the code differs from it (never shortened: a reader checks it out)."""
        if self.commit is None:
            return f"unknown ({self.error})"
        return self.commit + (" (with uncommitted changes: DIRTY RUN)" if self.dirty else "")

    def env(self) -> dict[str, str]:
        """What a child report process is given (see COMMIT_ENV)."""
        return {COMMIT_ENV: self.commit or f"unknown ({self.error})", DIRTY_ENV: "1" if self.dirty else "0"}


def git_state(exclude: Path | None = None, repo: Path | None = None) -> GitState:
    """HEAD of the checkout this code runs from (or `repo`), and whether tracked files outside `exclude` differ.
    Untracked files do not count (build outputs, caches); `exclude` is the folder of the reports being regenerated,
    since a run in chunks rewrites committed reports before the later chunks start."""
    here = repo or Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return GitState(None, True, "not a git checkout")  # code that cannot be pinned is not clean code
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        spec = [":/"]
        # git refuses a pathspec outside the repository: an out folder elsewhere excludes nothing of it anyway.
        if exclude is not None and top and exclude.resolve().is_relative_to(Path(top).resolve()):
            spec.append(f":(exclude){exclude.resolve()}")
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *spec],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return GitState(None, True, f"git not available: {e}")
    if status.returncode != 0:  # an unreadable state must not pass for a clean one
        return GitState(rev.stdout.strip(), True, f"git status failed: {status.stderr.strip()[:200]}")
    return GitState(rev.stdout.strip(), bool(status.stdout.strip()))


@functools.cache  # one report process, one state: every file it writes names the same one
def report_git_state() -> GitState:
    """The state `bench all` handed down (COMMIT_ENV), else this checkout's own. A report run by hand leaves the
    checkout's reports/ out of the dirty check, as `bench all` leaves its --out folder out: rewriting a committed
    report is the report's output, not a change to the code that made it."""
    given = os.environ.get(COMMIT_ENV)
    if given:
        commit = given if _HEX40.fullmatch(given) else None
        return GitState(commit, os.environ.get(DIRTY_ENV, "0") == "1", None if commit else given)
    return git_state(Path(__file__).resolve().parents[2] / "reports")


# int8 multiply-accumulates one core retires per cycle in the integer dot products of each ISA level's kernels
# (kernels/native), and the instruction that bounds it: the prefill's compute ceiling.
INT8_MACS_PER_CYCLE: dict[str, tuple[int, str]] = {
    "portable": (8, "SSE2 pmaddwd on int16-widened int8: 8 MACs per 128-bit instruction, one per cycle"),
    "avx2": (
        32,
        "AVX2 vpmaddubsw: 32 u8 x s8 MACs per 256-bit instruction, one per cycle (the vpmaddwd and vpaddd "
        "that widen and sum its pairs share the vector ports)",
    ),
    "avx512": (64, "AVX512-VNNI vpdpbusd: 64 MACs per 512-bit instruction, one per cycle"),
    "avx512_bf16": (64, "AVX512-VNNI vpdpbusd: 64 MACs per 512-bit instruction, one per cycle"),
    "amx": (1024, "AMX-INT8 tdpbusd: a 16x64 by 64x16 tile product (16,384 MACs) per 16 cycles"),
}


def cpu_clock(
    cpu_root: Path = Path("/sys/devices/system/cpu"), cpuinfo: Path = Path("/proc/cpuinfo")
) -> tuple[float, str]:
    """(Hz, where it came from): cpufreq's cpuinfo_max_freq (the highest clock the cores can run) where the kernel
    exposes it, else the highest "cpu MHz" in /proc/cpuinfo (under a hypervisor: the nominal clock it reports)."""
    try:
        khz = max(int(p.read_text()) for p in cpu_root.glob("cpu[0-9]*/cpufreq/cpuinfo_max_freq"))
        return khz * 1e3, "cpufreq cpuinfo_max_freq"
    except (OSError, ValueError):  # no cpufreq (a VM), or an unreadable file
        pass
    try:
        mhz = [float(line.split(":", 1)[1]) for line in cpuinfo.read_text().splitlines() if line.startswith("cpu MHz")]
    except (OSError, ValueError):
        mhz = []
    return (max(mhz) * 1e6, "/proc/cpuinfo cpu MHz") if mhz else (0.0, "unknown (no cpufreq, no cpu MHz)")


@dataclass(frozen=True)
class ComputePeak:
    """The cores' int8 compute ceiling: threads x clock x MACs per cycle x 2 FLOP per MAC."""

    level: str
    threads: int
    clock_hz: float
    clock_source: str
    macs_per_cycle: int
    why: str

    @property
    def flops(self) -> float:
        return 2.0 * self.macs_per_cycle * self.clock_hz * self.threads

    def describe(self) -> str:
        return (
            f"{self.flops / 1e9:.0f} GFLOP/s = {self.threads} cores x {self.clock_hz / 1e9:.3f} GHz "
            f"({self.clock_source}) x {self.macs_per_cycle} int8 MACs per cycle ({self.level}: {self.why}) x 2"
        )


def compute_peak(level: str, threads: int) -> ComputePeak:
    """The int8 peak of `threads` cores at the kernels' ISA `level` (base.machine.ISA_LEVELS)."""
    macs, why = INT8_MACS_PER_CYCLE.get(level, INT8_MACS_PER_CYCLE["portable"])
    hz, source = cpu_clock()
    return ComputePeak(level, threads, hz, source, macs, why)


def machine_summary() -> str:
    """The CPU, cores, memory and OS; with the GPU when this process's torch sees one (only when torch is already
    imported: a renderer that never imported it stays light, and describes the machine it ran on)."""
    mem = psutil.virtual_memory().total / 2**30
    text = f"{cpu_model()}, {os.cpu_count()} cores, {mem:.1f} GiB RAM, {platform.system()} {platform.release()}"
    gpu = gpu_summary()
    return f"{text}, {gpu}" if gpu else text


def gpu_summary() -> str | None:
    """ "GPU <name> (sm_XY, N GiB), CUDA V" when torch is imported and sees a GPU, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    return f"GPU {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB), CUDA {torch.version.cuda}"


# Settings from the environment that change what a benchmark measures: the ISA caps (glowplug's, torch's, oneDNN's).
# A report's command line starts with the ones set, so that it reproduces the run.
REPORTED_ENV: tuple[str, ...] = ("GLOWPLUG_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def command_line(argv: list[str] | None = None) -> str:
    args = sys.argv[1:] if argv is None else argv
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in REPORTED_ENV if os.environ.get(k)]
    return " ".join([*env, "glowplug", *(shlex.quote(a) for a in args)])


# The package's parts: their modules' bytecode is what a start imports (or, missing, compiles at every import).
_PACKAGES = tuple(f"glowplug{p}" for p in ("", ".base", ".kernels", ".engine", ".lifecycle", ".profiling"))


def _package_sources() -> list[Path]:
    import importlib.util

    dirs: set[Path] = set()
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        dirs.update(Path(loc) for loc in (spec.submodule_search_locations or []) if spec is not None)
    return sorted(p for d in dirs for p in d.rglob("*.py") if "__pycache__" not in p.parts)


def _stale_bytecode(sources: list[Path]) -> list[Path]:
    """The modules whose bytecode is missing or older than their source."""
    import importlib.util

    stale = []
    for src in sources:
        pyc = Path(importlib.util.cache_from_source(str(src)))
        if not pyc.is_file() or pyc.stat().st_mtime < src.stat().st_mtime:
            stale.append(src)
    return stale


def compile_package_bytecode() -> int:
    """Byte-compile the package's stale modules, as pip does when it installs a wheel, so that the starts a benchmark
    times import bytecode as a user's do (an editable install under PYTHONDONTWRITEBYTECODE would otherwise compile
    every module at every start); how many were compiled."""
    import py_compile

    stale = _stale_bytecode(_package_sources())
    for src in stale:
        py_compile.compile(str(src), quiet=1)
    return len(stale)


def bytecode_summary() -> str:
    sources = _package_sources()
    stale = len(_stale_bytecode(sources))
    return f"{len(sources) - stale} of {len(sources)} package modules byte-compiled" + (
        "" if stale == 0 else f" ({stale} compiled at each import)"
    )


def report_header(title: str, argv: list[str] | None = None) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in current_versions().items())
    return "\n".join(
        [
            f"# {title}",
            "",
            f"- command: `{command_line(argv)}`",
            f"- commit: {report_git_state().describe()}",
            f"- machine: {machine_summary()}",
            f"- versions: {versions}",
            f"- bytecode: {bytecode_summary()}",
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
        ]
    )
