"""Where each tensor-parallel rank records the stage it is in: one small JSON file per rank in a run folder.

What a failure names (engine/distributed.py) and what `/startup` shows for every rank. Only the standard library:
the API server reads the folder its engine core's ranks write, without importing torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

RUNDIR_ENV = "GLOWPLUG_TP_RUNDIR"  # the folder where every rank writes the stage it is in


def progress_path(rundir: Path, rank: int) -> Path:
    return rundir / f"rank-{rank}.json"


def write_progress(rundir: Path | None, rank: int, stage: str, state: str = "running") -> None:
    """Record the stage `rank` just began (or READY/FAILED): what a failure names, and what /startup shows."""
    if rundir is None:
        return
    path = progress_path(rundir, rank)
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(
            json.dumps({"rank": rank, "pid": os.getpid(), "stage": stage, "state": state, "time": time.time()})
        )
        os.replace(tmp, path)
    except OSError:
        pass  # progress is for the messages only; a lost line must not stop a start


def read_progress(rundir: Path | None, world_size: int) -> list[dict[str, Any]]:
    """Every rank's last recorded stage (a rank that recorded nothing yet: stage None)."""
    out = []
    for r in range(world_size):
        entry: dict[str, Any] = {"rank": r, "stage": None, "state": "starting"}
        if rundir is not None:
            try:
                entry.update(json.loads(progress_path(rundir, r).read_text()))
            except (OSError, ValueError):
                pass
        out.append(entry)
    return out
