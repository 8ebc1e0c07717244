"""Markdown tables whose every cell holds a number or says why it has none.

Seed 001 printed "NaN ms" rows and blank cells for runs that did not happen, with no reason given. Here a table
refuses an empty or NaN cell: a missing value is a `Missing(reason)` and renders as "n/a (reason)".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Align = Literal["l", "r"]


@dataclass(frozen=True)
class Missing:
    """A cell without a value, and the reason it has none (shown in the cell)."""

    reason: str

    def __str__(self) -> str:
        return f"n/a ({self.reason})"


Cell = str | float | int | Missing


def fmt_num(value: float, digits: int = 2) -> str:
    if not math.isfinite(value):
        raise ValueError(f"refusing to print a non-finite number ({value}); give the cell a Missing(reason)")
    return f"{value:,.{digits}f}"


def fmt_spread(values: Sequence[float], digits: int = 2) -> str:
    """ "median (min–max)" over repeats, or "value (n=1)" for one sample: one sample has no measured spread, and
    "± 0" or "x (x–x)" would claim one. No unit: the unit belongs in the column header, so a cell never reads
    like "0 (n=1)%"."""
    if not values:
        raise ValueError("no samples; give the cell a Missing(reason)")
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    if len(ordered) == 1:
        return f"{fmt_num(median, digits)} (n=1)"
    return f"{fmt_num(median, digits)} ({fmt_num(ordered[0], digits)}–{fmt_num(ordered[-1], digits)})"


def fmt_seconds(value: float | None, digits: int = 2, reason: str = "did not run") -> str:
    return str(Missing(reason)) if value is None else fmt_num(value, digits)


def _text(cell: Cell) -> str:
    if isinstance(cell, Missing):
        return str(cell)
    if isinstance(cell, bool):
        return "yes" if cell else "no"
    if isinstance(cell, int):
        return f"{cell:,}"
    if isinstance(cell, float):
        return fmt_num(cell)
    text = str(cell)
    if not text.strip():
        raise ValueError("refusing to print a blank cell; give it a value or a Missing(reason)")
    return text


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], align: Sequence[Align] | None = None) -> str:
    """A GitHub Markdown table; `align` per column ('l' or 'r', default: first left, the rest right)."""
    if align is None:
        align = ["l"] + ["r"] * (len(headers) - 1)
    if len(align) != len(headers):
        raise ValueError(f"{len(headers)} headers but {len(align)} alignments")
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join(":--" if a == "l" else "--:" for a in align) + "|",
    ]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(headers)} columns")
        lines.append("| " + " | ".join(_text(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(lines)
