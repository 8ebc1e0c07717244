"""Every target a verdict: a report that has a target says PASS or FAIL on its worst pair or run, in a section of
its own, and leaves the verdicts beside its Markdown (`<report>.verdicts.json`) so `glowplug bench all` shows FAIL
for the step instead of "ok" when a target is missed although the command exited 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .tables import markdown_table

SUFFIX = ".verdicts.json"


@dataclass(frozen=True)
class Verdict:
    """One target: what it asks, what the worst pair or run measured, and whether that meets it. `passed` None:
    the runs could not tell (too few, or the figure is missing), which is no PASS."""

    target: str
    measured: str
    passed: bool | None

    @property
    def word(self) -> str:
        return "PASS" if self.passed else "FAIL" if self.passed is False else "NO VERDICT"


def verdicts_markdown(verdicts: Sequence[Verdict]) -> str:
    """The verdicts section: one row per target, the overall word first."""
    if not verdicts:
        return "No target applies to this run."
    failed = [v for v in verdicts if v.passed is False]
    head = (
        f"**FAIL**: {len(failed)} of {len(verdicts)} targets missed"
        if failed
        else "**PASS**: every target met"
        if all(v.passed for v in verdicts)
        else "**NO VERDICT** on some targets (see below); none missed"
    )
    table = markdown_table(
        ["Target", "Measured (worst pair or run)", "Verdict"],
        [[v.target, v.measured, f"**{v.word}**"] for v in verdicts],
        ["l", "l", "l"],
    )
    return f"{head}\n\n{table}"


def sidecar(report: Path) -> Path:
    return report.with_name(report.stem + SUFFIX)


def write_verdicts(report: Path, verdicts: Sequence[Verdict]) -> Path:
    """`<report>.verdicts.json` beside the report (what `bench all` reads)."""
    path = sidecar(report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(v) for v in verdicts], indent=1) + "\n")
    return path


def read_verdicts(report: Path) -> list[dict[str, Any]] | None:
    """The verdicts left beside `report`, None when it left none (a report without targets)."""
    path = sidecar(report)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, list) else None


def failed_targets(report: Path) -> list[str]:
    """The targets `report`'s verdicts say were missed."""
    return [str(v.get("target")) for v in read_verdicts(report) or [] if v.get("passed") is False]
