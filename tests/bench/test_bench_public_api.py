"""The benchmarks drive the engine, the server and the kernels through their public API only: no module under
profiling/bench reaches a private name (`_x`) that another module owns. What a benchmark needs from the engine is a
public method of its owner (`LLMEngine.step_times`, `LLM.weight_traffic`, `LLMEngine.layer_kernels`, ...), so an
engine change that keeps that API never breaks a benchmark silently."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "profiling" / "bench"
PROBES = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.AST) -> set[str]:
    """The private names this module defines itself: its functions, classes, globals, and the attributes its own
    classes set or declare."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    return {n for n in own if _private(n)}


def foreign_private_uses(source: str, where: str) -> list[str]:
    """`where:line: what` for each private name `source` takes from another module: `obj._x` where `_x` is not
    this module's own, `from m import _x`, `from m._x import y` / `import m._x`, and getattr-style probes of a
    literal "_x"."""
    tree = ast.parse(source)
    own = _own_names(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            found.append(f"{where}:{node.lineno}: .{node.attr} ({ast.unparse(node)})")
        elif isinstance(node, ast.ImportFrom):
            if any(_private(p) for p in (node.module or "").split(".")):
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
            names = [a.name for a in node.names if _private(a.name)]
            found += [f"{where}:{node.lineno}: from {node.module} import {name}" for name in names]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names if any(_private(p) for p in a.name.split("."))]
            found += [f"{where}:{node.lineno}: import {name}" for name in modules]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES:
            name = node.args[1].value if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) else None
            if isinstance(name, str) and _private(name) and name not in own:
                found.append(f"{where}:{node.lineno}: {node.func.id}(..., {name!r})")
    return found


def test_bench_uses_no_private_name_of_another_module() -> None:
    files = sorted(BENCH.rglob("*.py"))
    assert len(files) > 30  # the scan reads the real tree
    found = [hit for f in files for hit in foreign_private_uses(f.read_text(), str(f.relative_to(BENCH.parents[1])))]
    assert not found, "private names used across modules (give the owner a public method):\n" + "\n".join(found)


def test_the_scan_names_each_kind_of_private_use() -> None:
    planted = """
from glowplug.profiling.bench.serve.workload import _WORDS
from torch._dynamo import config
import torch._inductor.config
import glowplug.engine.llm as llm_mod


class Mine:
    def __init__(self) -> None:
        self._lock = None

    def _helper(self) -> None:
        return None


def run(llm, guard, sink: Mine) -> None:
    llm._add(["x"], None, False)
    guard._refusal({})
    getattr(llm, "_engine")
    sink._lock
    sink._helper()
    self_ok = Mine()
    self_ok.__class__
"""
    hits = foreign_private_uses(planted, "planted.py")
    text = "\n".join(hits)
    for expected in (
        "planted.py:2: from glowplug.profiling.bench.serve.workload import _WORDS",
        "planted.py:3: from torch._dynamo import",
        "planted.py:4: import torch._inductor.config",
        "planted.py:17: ._add",
        "planted.py:18: ._refusal",
        "planted.py:19: getattr(..., '_engine')",
    ):
        assert expected in text, f"{expected!r} not in:\n{text}"
    assert len(hits) == 6, text  # the module's own `_lock` and `_helper` and dunders are not flagged
