"""The layers point down: lifecycle -> engine -> kernels -> base, with profiling's tracing and phase-table code
importable by all and `profiling.bench` by none of them; and no module imports another that imports it back.

Every `import` statement counts, at module level or inside a function (a deferred import is still a dependency,
and a deferred circle is still a circle), `TYPE_CHECKING` ones included: a reader follows those too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> installed package (pyproject's package-dir).
PACKAGES = {"glowplug": "glowplug", "base": "glowplug.base", "engine": "glowplug.engine",
            "kernels": "glowplug.kernels", "lifecycle": "glowplug.lifecycle", "profiling": "glowplug.profiling"}  # fmt: skip

# Higher may import lower or equal; equal only within the same layer. The front door (the CLI) and the benchmarks
# sit on top: they drive everything and nothing below them may reach up into them.
LAYERS: dict[str, int] = {
    "profiling": 0,  # tracing, names, phase table, memory: imported by all, imports none of the others
    "base": 1,
    "kernels": 2,
    "engine": 3,
    "lifecycle": 4,
    "bench": 5,  # glowplug.profiling.bench
    "front": 6,  # glowplug.cli, glowplug.cache_cli
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    pkg = PACKAGES[rel.parts[0]]
    parts = [*pkg.split("."), *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[:3] == ["glowplug", "profiling", "bench"]:
        return "bench"
    if len(parts) == 1 or parts[1] not in {"base", "engine", "kernels", "lifecycle", "profiling"}:
        return "front"
    return parts[1]


def _sources() -> dict[str, Path]:
    out = {}
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            out[_module_name(path)] = path
    return out


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported glowplug module: line}; `from pkg import name` counts as pkg.name when that is a module."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(name, is_package, node)
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("glowplug") and target != name and not name.startswith(target + "."):
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


MODULES = _sources()
GRAPH = _imports(MODULES)


def _where(module: str, line: int | None = None) -> str:
    rel = MODULES[module].relative_to(ROOT)
    return f"{rel}:{line}" if line else str(rel)


def test_every_import_points_down() -> None:
    wrong = []
    for importer, edges in GRAPH.items():
        for imported, line in edges.items():
            a, b = _layer(importer), _layer(imported)
            if LAYERS[b] > LAYERS[a] or (LAYERS[b] == LAYERS[a] and a != b):
                wrong.append(f"{_where(importer, line)} ({a}) imports {_where(imported)} ({b})")
    assert not wrong, "upward imports:\n" + "\n".join(sorted(wrong))


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
        pairs = [f"{_where(a, line)} imports {_where(b)}" for a in comp for b, line in GRAPH[a].items() if b in inside]
        described.append("circle of " + ", ".join(_where(m) for m in comp) + ":\n  " + "\n  ".join(pairs))
    assert not described, "\n".join(described)


def test_the_checker_sees_an_upward_import_and_a_circle() -> None:
    """The two checks above are only as good as the graph: a planted upward import and a planted circle show up."""
    graph = {k: dict(v) for k, v in GRAPH.items()}
    graph["glowplug.kernels.formats"]["glowplug.engine.config"] = 1
    graph["glowplug.engine.config"]["glowplug.kernels.formats"] = 1
    assert any({"glowplug.kernels.formats", "glowplug.engine.config"} <= set(c) for c in _cycles(graph))
    assert _layer("glowplug.kernels.formats") == "kernels" and LAYERS["engine"] > LAYERS["kernels"]
    # And the real graph is not empty: the engine imports kernels, the kernels import base.
    assert "glowplug.kernels.formats" in GRAPH["glowplug.engine.kv_cache"]
    assert any(t.startswith("glowplug.base") for t in GRAPH["glowplug.kernels.dispatch"])


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
