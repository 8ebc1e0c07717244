"""`glowplug bench startup --poll-serve`: one `glowplug serve` start polled on `GET /startup` every 0.2 s until READY,
the way an autoscaler or a load balancer watches it: at every poll the response must name a stage that is running,
and its ETA must be within ETA_POLL_TARGET of the time READY was in fact still away.

The server's clock is the one both sides use: `elapsed_s` of each poll and the phase table's `actual_total_time`
are seconds from process creation, so the remaining time at a poll is actual_total_time - elapsed_s, exactly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .startup_runs import CACHE_ENV

POLL_S = 0.2
ETA_POLL_TARGET = 0.30
# A poll this close to READY is not held to the relative target: READY is a poll interval away, and an ETA of
# 0.1 s against 0.05 s left is no error anyone acts on.
NEAR_READY_S = POLL_S


@dataclass(frozen=True)
class Poll:
    elapsed_s: float  # the server's seconds from process creation at this poll
    state: str
    running: list[str]
    eta_s: float | None
    remaining_s: float | None = None  # READY - elapsed, filled in once READY is known

    @property
    def error(self) -> float | None:
        """(ETA - remaining) / remaining; None without an ETA or too near READY to judge (NEAR_READY_S)."""
        if self.eta_s is None or self.remaining_s is None or self.remaining_s < NEAR_READY_S:
            return None
        return self.eta_s / self.remaining_s - 1


@dataclass
class ServePoll:
    """One polled serve start: every poll while STARTING, READY's time, and what went wrong if anything."""

    polls: list[Poll] = field(default_factory=list)
    ready_s: float | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "ready_s": self.ready_s,
            "error": self.error,
            "polls": [{**asdict(p), "error": p.error} for p in self.polls],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServePoll:
        polls = [
            Poll(p["elapsed_s"], p["state"], list(p["running"]), p["eta_s"], p.get("remaining_s"))
            for p in data.get("polls", [])
        ]
        return cls(polls, data.get("ready_s"), data.get("error"))

    @property
    def unnamed(self) -> list[Poll]:
        """Polls while starting that named no running stage."""
        return [p for p in self.polls if not p.running]

    @property
    def worst(self) -> Poll | None:
        judged = [p for p in self.polls if p.error is not None]
        return max(judged, key=lambda p: abs(p.error or 0.0)) if judged else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll_serve(serve_args: list[str], cache: Path, timeout_s: float, env: dict[str, str] | None = None) -> ServePoll:
    """Start `glowplug serve <serve_args>` with GLOWPLUG_CACHE_DIR=cache, poll /startup every POLL_S until READY,
    stop it (SIGTERM), and fill in each poll's remaining time from the phase table's actual_total_time."""
    import httpx

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="glowplug-bench-poll-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "glowplug.cli", "serve", *serve_args, "--port", str(port)]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**(env or os.environ), CACHE_ENV: str(cache)}
    )
    result = ServePoll()
    try:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=base, timeout=5.0, trust_env=False) as http:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    result.error = f"the server exited with status {proc.returncode} before READY (log: {log.name})"
                    return result
                t0 = time.monotonic()
                try:
                    info = http.get("/startup").json()
                except (httpx.TransportError, ValueError):
                    time.sleep(POLL_S)
                    continue
                if info["state"] != "starting":
                    table = info.get("phase_table") or {}
                    result.ready_s = table.get("actual_total_time")
                    if info["state"] != "ready":
                        result.error = f"the start ended {info['state']}: {info.get('reason')}"
                    break
                result.polls.append(
                    Poll(
                        float(info["elapsed_s"]),
                        info["state"],
                        list(info.get("running_phases") or []),
                        info.get("eta_s"),
                    )
                )
                time.sleep(max(0.0, POLL_S - (time.monotonic() - t0)))
            else:
                result.error = f"not READY after {timeout_s:g} s"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
    if result.ready_s is not None:
        ready = float(result.ready_s)
        result.polls = [Poll(p.elapsed_s, p.state, p.running, p.eta_s, ready - p.elapsed_s) for p in result.polls]
    return result


def poll_text(poll: ServePoll | None) -> str:
    """The report's section: how many polls, the worst ETA error and the polls that named no stage."""
    if poll is None:
        return "Not run (--poll-serve makes it)."
    if poll.error is not None:
        return f"The polled serve start failed: {poll.error}"
    worst = poll.worst
    lines = [
        f"One `glowplug serve` start in the warm cache dir, `GET /startup` every {POLL_S:g} s until READY "
        f"({poll.ready_s:.3f} s from process creation): {len(poll.polls)} polls while starting, "
        f"{len(poll.polls) - len(poll.unnamed)} of them naming a running stage."
    ]
    if worst is not None and worst.error is not None:
        lines.append(
            f"Worst ETA error against the time READY was still away: {100 * worst.error:+.1f}% at "
            f"{worst.elapsed_s:.2f} s (ETA {worst.eta_s:.2f} s, {worst.remaining_s:.2f} s left; polls "
            f"within {NEAR_READY_S:g} s of READY are not judged)."
        )
    rows = ["| elapsed (s) | running | ETA (s) | left (s) | error |", "|--:|:--|--:|--:|--:|"]
    for p in poll.polls:
        err = "-" if p.error is None else f"{100 * p.error:+.1f}%"
        eta = "-" if p.eta_s is None else f"{p.eta_s:.2f}"
        left = "-" if p.remaining_s is None else f"{p.remaining_s:.2f}"
        rows.append(f"| {p.elapsed_s:.2f} | {', '.join(p.running) or '**none**'} | {eta} | {left} | {err} |")
    return "\n".join([" ".join(lines), "", *rows])


def poll_verdicts(poll: ServePoll | None) -> list[Any]:
    from .verdicts import Verdict

    if poll is None:
        return []
    if poll.error is not None:
        return [Verdict("a polled serve start reaches READY", poll.error, False)]
    worst = poll.worst
    return [
        Verdict(
            "every /startup poll while starting names a running stage",
            f"{len(poll.unnamed)} of {len(poll.polls)} polls named none",
            not poll.unnamed,
        ),
        Verdict(
            f"every poll's ETA within {ETA_POLL_TARGET:.0%} of the time left to READY",
            "no poll to judge"
            if worst is None or worst.error is None
            else f"worst {100 * worst.error:+.1f}% at {worst.elapsed_s:.2f} s",
            None if worst is None or worst.error is None else abs(worst.error) <= ETA_POLL_TARGET,
        ),
    ]
