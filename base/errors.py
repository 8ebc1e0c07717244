"""Error text shared by every layer: one line for a status line, a span status and a table row."""

from __future__ import annotations

import importlib.util


def one_line(exc: BaseException) -> str:
    """`TypeName: first line of the message`, short enough for a status line and a span status."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    summary = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return summary if len(summary) <= 300 else summary[:297] + "..."


class MissingExtra(ImportError):
    """A package of one of glowplug's pip extras is not installed; the message names the extra (the CLI prints it
    as one line)."""


def require_extra(modules: tuple[str, ...], needed_by: str, extra: str) -> None:
    """MissingExtra naming the pip extra to install when one of `modules` is missing, checked without importing
    them: transformers and accelerate are not runtime dependencies (serving never imports them), only the `test`
    and `bench` extras bring them, and a command that needs them should say so before it spends any time."""
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise MissingExtra(f"{needed_by} needs {' and '.join(missing)}: `pip install glowplug[{extra}]`")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # an import hook that refuses the module: as good as not installed
        return False
