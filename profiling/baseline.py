"""The start-up regression gate: a stored baseline (each phase's median over N starts of one kind, with its spread)
and the comparison of one start's phase table against it.

`glowplug bench startup --save-baseline FILE` writes the baseline from its cold and warm starts; `glowplug startup
--baseline FILE [--max-regression 10%]` compares the start it just ran with the baseline of the same kind (warm
with warm, cold with cold: the kind comes from the start's cache pattern) and exits non-zero naming every phase
that regressed beyond noise.

Beyond noise: a phase regressed when its seconds exceed median x (1 + max_regression) + noise. The noise is three
standard deviations of the phase over the baseline's starts, estimated from their range (max - min) as a control
chart does (sigma = range / d2(N), d2 the expected range of N normal samples), and at least NOISE_FLOOR_S: a phase
of a few milliseconds that doubles is not a regression anyone can see, and one the baseline itself saw vary by
0.2 s must move by more than that. Fewer starts give a wider margin for the same range (3 / d2(2) = 2.7 range
widths for two starts, 1.0 for ten). The phases gated are the table's leaves (each stage's own time, the pre-main
rows) and the time to READY; derived rows (overlap, critical path, the floor's probe) are not.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glowplug.profiling.names import Attr, Row

BASELINE_FORMAT = "glowplug-startup-baseline/1"
NOISE_FLOOR_S = 0.1
NOISE_SIGMAS = 3.0
# d2(N): the expected range of N samples of a unit normal (the control-chart constant), N = 2..10.
_D2 = {2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326, 6: 2.534, 7: 2.704, 8: 2.847, 9: 2.970, 10: 3.078}
DEFAULT_MAX_REGRESSION = 0.10
# Leaves that are bookkeeping, not work (the wall time no stage claims).
NOT_GATED = frozenset({Row.UNATTRIBUTED})


def start_kind_of(report: Mapping[str, Any]) -> str:
    """ "cold", "warm", "partly warm" or "" from a report's cache pattern ("compile=hit, model=hit, ..."); the page
    cache is left out, as the ETA's kinds leave it out."""
    pattern = str(report.get("attributes", {}).get(Row.ACTUAL_TOTAL_TIME, {}).get(Attr.CACHE_PATTERN, ""))
    states = [kv.split("=", 1)[1] for kv in pattern.split(", ") if "=" in kv and not kv.startswith("page_cache=")]
    states = [s for s in states if s != "unknown"]
    if not states:
        return ""
    if all(s == "hit" for s in states):
        return "warm"
    return "cold" if all(s == "miss" for s in states) else "partly warm"


def gated_rows(report: Mapping[str, Any]) -> list[str]:
    """The rows of a report (profiling/phases.py to_dict) the gate compares: leaves and the time to READY."""
    kinds: Mapping[str, str] = report.get("kinds", {})
    return [n for n, k in kinds.items() if k == "leaf" and n not in NOT_GATED] + [Row.ACTUAL_TOTAL_TIME]


@dataclass(frozen=True)
class PhaseBaseline:
    """One phase over the baseline's starts: its median, its spread (max - min), and the samples."""

    median: float
    spread: float
    samples: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {"median": self.median, "spread": self.spread, "samples": list(self.samples)}


def baseline_from_reports(reports: Sequence[Mapping[str, Any]]) -> dict[str, PhaseBaseline]:
    """Each gated phase over `reports` (phase-table JSON of starts of one kind): the phases that ran in every one."""
    if not reports:
        return {}
    out: dict[str, PhaseBaseline] = {}
    for row in gated_rows(reports[0]):
        values = [r.get("phases", {}).get(row) for r in reports]
        if all(isinstance(v, (int, float)) for v in values):
            samples = tuple(float(v) for v in values)  # type: ignore[arg-type]
            out[row] = PhaseBaseline(statistics.median(samples), max(samples) - min(samples), samples)
    return out


def write_baseline(
    path: Path, by_kind: Mapping[str, Sequence[Mapping[str, Any]]], *, command: str, machine: str, commit: str
) -> Path:
    """Write a baseline of every kind of start in `by_kind` (kind -> its starts' reports)."""
    kinds = {
        k: {"starts": len(rs), "phases": {n: b.to_json() for n, b in baseline_from_reports(rs).items()}}
        for k, rs in by_kind.items()
        if rs
    }
    data = {"format": BASELINE_FORMAT, "command": command, "machine": machine, "commit": commit, "kinds": kinds}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def read_baseline(path: Path) -> dict[str, Any]:
    """A baseline file; ValueError naming the file and the fix when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--baseline {path}: cannot read it ({exc}); write one with `glowplug bench startup --save-baseline FILE`"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT:
        raise ValueError(
            f"--baseline {path}: not a start-up baseline (format {BASELINE_FORMAT}); write one with "
            "`glowplug bench startup --save-baseline FILE`"
        )
    return data


@dataclass(frozen=True)
class PhaseCheck:
    """One phase of the start against the baseline: its seconds, the limit, and whether it regressed."""

    phase: str
    seconds: float
    median: float
    spread: float
    limit: float

    @property
    def regressed(self) -> bool:
        return self.seconds > self.limit

    @property
    def change(self) -> float:
        return self.seconds / self.median - 1 if self.median > 0 else float("inf")


@dataclass(frozen=True)
class GateResult:
    kind: str
    checks: tuple[PhaseCheck, ...]
    missing: tuple[str, ...]  # phases of the baseline this start did not run (said, not failed)

    @property
    def regressed(self) -> list[PhaseCheck]:
        return [c for c in self.checks if c.regressed]

    @property
    def passed(self) -> bool:
        return not self.regressed

    def summary(self) -> str:
        """One line: PASS, or FAIL naming every regressed phase with its change and limit."""
        if self.passed:
            return f"start-up regression gate: PASS ({len(self.checks)} phases within the {self.kind} baseline)"
        named = "; ".join(
            f"{c.phase} {c.seconds:.3f} s vs median {c.median:.3f} s ({100 * c.change:+.0f}%, limit {c.limit:.3f} s)"
            for c in self.regressed
        )
        return f"start-up regression gate: FAIL, regressed beyond noise: {named}"


def noise_of(spread: float, starts: int) -> float:
    """Three sigmas of a phase whose `starts` baseline samples spanned `spread` seconds (module docstring)."""
    d2 = _D2.get(starts, 3.078 if starts > 10 else 1.128)
    return max(NOISE_FLOOR_S, NOISE_SIGMAS * spread / d2)


def limit_of(median: float, spread: float, max_regression: float, starts: int = 2) -> float:
    """The most a phase may take before it counts as regressed (module docstring)."""
    return median * (1 + max_regression) + noise_of(spread, starts)


def check(
    report: Mapping[str, Any],
    baseline: Mapping[str, Any],
    max_regression: float = DEFAULT_MAX_REGRESSION,
    kind: str | None = None,
) -> GateResult:
    """The start in `report` (phase-table JSON) against the baseline of its kind. ValueError when the baseline
    has no starts of that kind."""
    kind = kind if kind is not None else start_kind_of(report)
    kinds = baseline.get("kinds", {})
    if kind == "" and "warm" in kinds:
        kind = "warm"  # a start no cache is involved in: every start of it is as warm as it gets
    if kind not in kinds:
        have = ", ".join(sorted(kinds)) or "none"
        raise ValueError(
            f"the baseline has no {kind or 'unclassified'} starts (it has: {have}); save one with the "
            f"starts of this kind"
        )
    phases: Mapping[str, Mapping[str, Any]] = kinds[kind]["phases"]
    seconds: Mapping[str, Any] = report.get("phases", {})
    checks, missing = [], []
    for phase, b in phases.items():
        value = seconds.get(phase)
        if not isinstance(value, (int, float)):
            missing.append(phase)
            continue
        median, spread = float(b["median"]), float(b["spread"])
        limit = limit_of(median, spread, max_regression, len(b.get("samples", ())) or 2)
        checks.append(PhaseCheck(phase, float(value), median, spread, limit))
    return GateResult(kind, tuple(checks), tuple(missing))


def parse_fraction(text: str) -> float:
    """ "10%", "10 %" or "0.1" -> 0.1; ValueError naming the value otherwise."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"--max-regression {text!r}: give a percentage (10%) or a fraction (0.1)") from None
    if value < 0:
        raise ValueError(f"--max-regression {text!r}: must not be negative")
    return value
