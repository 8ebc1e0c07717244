"""Error text shared by every layer: one line for a status line, a span status and a table row."""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """`TypeName: first line of the message`, short enough for a status line and a span status."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    summary = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return summary if len(summary) <= 300 else summary[:297] + "..."
