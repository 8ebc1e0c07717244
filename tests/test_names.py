"""Span names, attribute keys and metric names are written once, in profiling/names.py: any other module of the
package that spells one of them as a literal string fails here, named by file:line (a renamed key must change
every use, which only a constant guarantees)."""

from __future__ import annotations

import ast
from pathlib import Path

from glowplug.profiling import names

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("base", "engine", "kernels", "lifecycle", "profiling", "glowplug")
NAMES_FILE = ROOT / "profiling" / "names.py"


def _defined() -> set[str]:
    """Every `glowplug.x` / `glowplug_x` string names.py defines, at module level or in its classes."""
    scopes = [vars(names), *(vars(v) for v in vars(names).values() if isinstance(v, type))]
    return {
        v
        for scope in scopes
        for k, v in scope.items()
        if k.isupper() and isinstance(v, str) and v.startswith((f"{names.PREFIX}.", f"{names.PREFIX}_"))
    }


def _callee(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def literal_uses(path: Path, defined: set[str]) -> list[tuple[int, str]]:
    """(line, string) for each string literal in `path` that is one of `defined` (f-string parts included). A
    logger's name is not a span's even where the two read the same (`get_logger("glowplug.startup")`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    loggers = {
        id(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and node.args and _callee(node.func) == "get_logger"
    }
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in defined
        and id(node) not in loggers
    )


def test_the_scan_sees_a_spelled_out_key(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "span.set_attribute(\"glowplug.cache_hit\", True)\nx = attrs.get('glowplug_prompt_tokens')\n"
        'log = get_logger("glowplug.startup.x")\n'
    )
    assert literal_uses(sample, _defined()) == [(1, "glowplug.cache_hit"), (2, "glowplug_prompt_tokens")]


def test_names_are_spelled_only_in_names_py() -> None:
    defined = _defined()
    wrong = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != NAMES_FILE:
                wrong += [f"{path.relative_to(ROOT)}:{line}: {value!r}" for line, value in literal_uses(path, defined)]
    assert not wrong, "names spelled out instead of taken from profiling/names.py:\n" + "\n".join(wrong)
