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

from ...base.machine import PROBE_BYTES, PROBE_REPEATS, cpu_model, measure_probe
from ..phases import current_versions

__all__ = ["COMMIT_ENV", "DIRTY_ENV", "PROBE_BYTES", "PROBE_REPEATS", "GitState", "command_line", "cpu_model",
           "git_state", "gpu_summary", "machine_summary", "measure_probe", "report_git_state", "report_header"]

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
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()  # fmt: skip
        spec = [":/"]
        # git refuses a pathspec outside the repository: an out folder elsewhere excludes nothing of it anyway.
        if exclude is not None and top and exclude.resolve().is_relative_to(Path(top).resolve()):
            spec.append(f":(exclude){exclude.resolve()}")
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *spec],
                                cwd=here, capture_output=True, text=True, timeout=10)  # fmt: skip
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



def machine_summary() -> str:
    """The CPU, cores, memory and OS; with the GPU when this process's torch sees one (only when torch is already
    imported: a renderer that never imported it stays light, and describes the machine it ran on)."""
    mem = psutil.virtual_memory().total / 2**30
    text = f"{cpu_model()}, {os.cpu_count()} cores, {mem:.1f} GiB RAM, {platform.system()} {platform.release()}"
    gpu = gpu_summary()
    return f"{text}, {gpu}" if gpu else text


def gpu_summary() -> str | None:
    """"GPU <name> (sm_XY, N GiB), CUDA V" when torch is imported and sees a GPU, else None."""
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
            f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
        ]
    )
