"""The layers point down: lifecycle -> engine -> kernels -> base, with profiling's tracing and phase-table code
importable by all, `profiling.bench` by none of them, the torch door (base/torch_compat.py) importable by every layer
and importing none; and no module imports another that imports it back.

A dependency is anything a reader would follow: every `import` statement, at module level or inside a function (a
deferred import is still a dependency, and a deferred circle is still a circle), `TYPE_CHECKING` ones included; a
module named as a string to `importlib.import_module`, `importlib.util.find_spec` or `__import__`; and a process
started on `-m glowplug...` or on a `scripts/*.py` file (an argv list). scripts/ are read too, as the top layer. A
name the checker cannot read (an f-string naming a glowplug module) fails unless it is a known exception below.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> installed package (pyproject's package-dir); scripts/ is not installed, its files are `scripts.x`.
PACKAGES = {
    "glowplug": "glowplug",
    "base": "glowplug.base",
    "engine": "glowplug.engine",
    "kernels": "glowplug.kernels",
    "lifecycle": "glowplug.lifecycle",
    "profiling": "glowplug.profiling",
    "scripts": "scripts",
}
DOOR = "glowplug.base.torch_compat"

# Higher may import lower or equal; equal only within the same layer. The front door (the CLI) and the benchmarks
# sit on top: they drive everything and nothing below them may reach up into them.
LAYERS: dict[str, int] = {
    "door": -1,  # base/torch_compat.py: torch's private names, imports nothing of glowplug's
    "profiling": 0,  # tracing, names, phase table, memory: imported by all, imports none of the others
    "base": 1,
    "kernels": 2,
    "engine": 3,
    "lifecycle": 4,
    "bench": 5,  # glowplug.profiling.bench
    "front": 6,  # glowplug.cli, glowplug.cache_cli
    "scripts": 7,  # scripts/*.py: run by hand or by CI, never by the package
}
# A process edge the layers allow although an import would not be: the benchmarks time the CLI as a user runs it,
# from outside (a process boundary, no shared code).
PROCESS_ALLOWED = {("bench", "front")}
# Known exceptions: (file, what it names) -> why. Each must still be there (test_known_exceptions_are_current), so
# one removed from the code is removed here.
KNOWN: dict[tuple[str, str], str] = {
    ("base/artifacts/caches.py", "glowplug.{sub}"): "source_digest hashes the .py files of the subpackages its "
    "caller names (the cache key of code-made artifacts): it reads their folders and imports none of them",
}
IMPORTERS = {"import_module", "find_spec", "__import__"}
SCRIPT_PATH = re.compile(r"(?:^|/)scripts/(\w+)\.py$")


@dataclass(frozen=True)
class Edge:
    line: int
    how: str  # "import", "import_module", "find_spec", "__import__", "-m" (a process), "script" (a process)

    @property
    def process(self) -> bool:
        return self.how in ("-m", "script")


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root)
    pkg = PACKAGES[rel.parts[0]]
    parts = [*pkg.split("."), *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if module == DOOR:
        return "door"
    if parts[0] == "scripts":
        return "scripts"
    if parts[:3] == ["glowplug", "profiling", "bench"]:
        return "bench"
    if len(parts) == 1 or parts[1] not in {"base", "engine", "kernels", "lifecycle", "profiling"}:
        return "front"
    return parts[1]


def _sources(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for folder in PACKAGES:
        for path in (root / folder).rglob("*.py"):
            out[_module_name(path, root)] = path
    return out


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _callee(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _alternatives(arg: ast.expr) -> list[ast.expr]:
    """The values an argument can take that the checker can read: both arms of `a if c else b`."""
    if isinstance(arg, ast.IfExp):
        return [*_alternatives(arg.body), *_alternatives(arg.orelse)]
    return [arg]


def _references(
    name: str, path: Path, modules: dict[str, Path]
) -> tuple[list[tuple[str, Edge]], list[tuple[str, int]]]:
    """What one file depends on: (target, edge) pairs, and the glowplug names it builds at run time (unreadable)."""
    found: list[tuple[str, Edge]] = []
    unreadable: list[tuple[str, int]] = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, Edge(node.lineno, "import")) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, is_package, node)
            found += [
                (f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod, Edge(node.lineno, "import"))
                for a in node.names
            ]
        elif isinstance(node, ast.Call) and _callee(node.func) in IMPORTERS and node.args:
            for arg in _alternatives(node.args[0]):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((arg.value, Edge(node.lineno, _callee(node.func))))
                elif isinstance(arg, ast.JoinedStr):
                    text = "".join(
                        v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                        for v in arg.values
                        if isinstance(v, (ast.Constant, ast.FormattedValue))
                    )
                    if text.startswith("glowplug"):
                        unreadable.append((text, node.lineno))
        elif isinstance(node, (ast.List, ast.Tuple)):
            items = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in node.elts]
            for i, item in enumerate(items):
                if item == "-m" and i + 1 < len(items) and (items[i + 1] or "").startswith("glowplug"):
                    found.append((items[i + 1] or "", Edge(node.lineno, "-m")))
                elif item is not None and (m := SCRIPT_PATH.search(item)):
                    found.append((f"scripts.{m[1]}", Edge(node.lineno, "script")))
    return found, unreadable


def _imports(modules: dict[str, Path]) -> tuple[dict[str, dict[str, Edge]], list[tuple[str, str, int]]]:
    """module -> {glowplug or scripts module it depends on: the first such edge}; `from pkg import name` counts as
    pkg.name when that is a module. And every (module, unreadable name, line)."""
    graph: dict[str, dict[str, Edge]] = {}
    unreadable: list[tuple[str, str, int]] = []
    for name, path in modules.items():
        edges: dict[str, Edge] = {}
        found, dynamic = _references(name, path, modules)
        for target, edge in found:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges.setdefault(target, edge)
        graph[name] = edges
        unreadable += [(name, text, line) for text, line in dynamic]
    return graph, unreadable


MODULES = _sources()
GRAPH, UNREADABLE = _imports(MODULES)


def _where(module: str, line: int | None = None, modules: dict[str, Path] = MODULES) -> str:
    path = modules[module]
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return f"{rel}:{line}" if line else str(rel)


def _known(module: str, target: str, modules: dict[str, Path] = MODULES) -> bool:
    return (_where(module, modules=modules), target) in KNOWN


def upward(graph: dict[str, dict[str, Edge]], modules: dict[str, Path] = MODULES) -> list[str]:
    """Every edge that points up (or sideways between layers), named by file:line, minus the known exceptions."""
    wrong = []
    for importer, edges in graph.items():
        for imported, edge in edges.items():
            a, b = _layer(importer), _layer(imported)
            if edge.process and (a, b) in PROCESS_ALLOWED:
                continue
            if (LAYERS[b] > LAYERS[a] or (LAYERS[b] == LAYERS[a] and a != b)) and not _known(
                importer, imported, modules
            ):
                wrong.append(
                    f"{_where(importer, edge.line, modules)} ({a}) {edge.how} {_where(imported, None, modules)} ({b})"
                )
    return sorted(wrong)


def unreadable(found: list[tuple[str, str, int]], modules: dict[str, Path] = MODULES) -> list[str]:
    return sorted(f"{_where(m, line, modules)}: {text!r}" for m, text, line in found if not _known(m, text, modules))


def test_every_import_points_down() -> None:
    wrong = upward(GRAPH)
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


def test_every_glowplug_name_is_readable() -> None:
    wrong = unreadable(UNREADABLE)
    assert not wrong, "glowplug modules named at run time (name them literally, or give the reason in KNOWN):\n" + (
        "\n".join(wrong)
    )


def test_known_exceptions_are_current() -> None:
    """An exception whose code is gone is dropped from KNOWN, so the list says what is really there."""
    present = {(_where(m), t) for m, edges in GRAPH.items() for t in edges}
    present |= {(_where(m), text) for m, text, _ in UNREADABLE}
    stale = sorted(f"{f}: {t}" for f, t in KNOWN if (f, t) not in present)
    assert not stale, "KNOWN names exceptions that are no longer in the code:\n" + "\n".join(stale)


def _cycles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), over imports (a process is not a circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in (w for w, e in graph.get(v, {}).items() if not e.process):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    described = []
    for comp in _cycles(GRAPH):
        inside = set(comp)
        pairs = [f"{_where(a, e.line)} imports {_where(b)}" for a in comp for b, e in GRAPH[a].items() if b in inside]
        described.append("circle of " + ", ".join(_where(m) for m in comp) + ":\n  " + "\n  ".join(pairs))
    assert not described, "\n".join(described)


PLANTED = {
    "kernels/planted_import.py": "import os\n\n\ndef f():\n    from glowplug.lifecycle.service import Service\n",
    "kernels/planted_string.py": "import importlib\n\nX = importlib.import_module('glowplug.lifecycle.app')\n",
    "kernels/planted_spec.py": "from importlib.util import find_spec\n\nS = find_spec('glowplug.engine.llm')\n",
    "kernels/planted_process.py": "import sys\n\nCMD = [sys.executable, '-m', 'glowplug.engine.core_proc']\n",
    "engine/planted_script.py": "import sys\n\nCMD = (sys.executable, 'scripts/synthetic_gguf.py', '--help')\n",
    "engine/planted_dynamic.py": "import importlib\n\n\ndef f(x):\n"
    "    return importlib.import_module(f'glowplug.{x}')\n",
    "profiling/bench/planted_cli.py": "import sys\n\nCMD = [sys.executable, '-m', 'glowplug.cli', 'startup']\n",
}


def test_the_checker_sees_each_kind_of_upward_dependency_and_a_circle(tmp_path: Path) -> None:
    """The checks above are only as good as the graph: files planted beside the real ones (in a temporary tree, the
    real graph's modules with them) show up, each named by file:line; the benchmarks' CLI process does not."""
    planted: dict[str, Path] = {}
    for rel, text in PLANTED.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        planted[_module_name(path, tmp_path)] = path
    modules = {**MODULES, **planted}
    graph, dynamic = _imports(modules)
    wrong = upward(graph, modules)
    t = tmp_path
    assert wrong == [
        f"{t}/engine/planted_script.py:3 (engine) script scripts/synthetic_gguf.py (scripts)",
        f"{t}/kernels/planted_import.py:5 (kernels) import lifecycle/service.py (lifecycle)",
        f"{t}/kernels/planted_process.py:3 (kernels) -m engine/core_proc.py (engine)",
        f"{t}/kernels/planted_spec.py:3 (kernels) find_spec engine/llm.py (engine)",
        f"{t}/kernels/planted_string.py:3 (kernels) import_module lifecycle/app.py (lifecycle)",
    ]
    assert unreadable(dynamic, modules) == [f"{t}/engine/planted_dynamic.py:5: 'glowplug.{{x}}'"]
    # A planted circle through two real modules shows up as one.
    graph["glowplug.kernels.formats"]["glowplug.engine.config"] = Edge(1, "import")
    graph["glowplug.engine.config"]["glowplug.kernels.formats"] = Edge(1, "import")
    assert any({"glowplug.kernels.formats", "glowplug.engine.config"} <= set(c) for c in _cycles(graph))
    # And the real graph is not empty: the engine imports kernels, the kernels import base and the torch door.
    assert "glowplug.kernels.formats" in GRAPH["glowplug.engine.kv_cache"]
    assert any(t.startswith("glowplug.base") for t in GRAPH["glowplug.kernels.dispatch"])
    assert DOOR in GRAPH["glowplug.kernels.cpu"] and not GRAPH[DOOR]


@pytest.mark.parametrize("module", ["transformers", "accelerate"])
def test_serving_code_does_not_import_test_only_packages_at_module_level(module: str) -> None:
    """transformers and accelerate are extras (`test`, `bench`): nothing the server imports may need them at import."""
    offenders = []
    for name, path in MODULES.items():
        if _layer(name) in {"bench", "front"} and name != "glowplug.cli":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == module for a in node.names):
                offenders.append(_where(name, node.lineno))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == module:
                offenders.append(_where(name, node.lineno))
    assert not offenders, f"module-level imports of {module}: {offenders}"
