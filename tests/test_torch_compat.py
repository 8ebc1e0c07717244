"""The one door to torch's internals (base/torch_compat.py): nothing else in the engine uses them, the capability
check names what is missing, and a start whose torch fails the check, or that cannot compile, still reaches READY
under `--compile auto` (eagerly, saying why on the rows) while `--compile on` fails naming the reason."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glowplug.base import torch_compat
from glowplug.base.torch_compat import FAIL_ENV, SUPPORTED_RANGE, TorchInternalsUnavailable, _Need

ROOT = Path(__file__).resolve().parents[1]
DOOR = ROOT / "base" / "torch_compat.py"
# The whole package: every layer reaches torch's internals through the door (it sits below all of them), no exceptions.
SOURCES = ("base", "engine", "kernels", "lifecycle", "profiling", "glowplug")


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def _dotted(node: ast.AST) -> str | None:
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(names)])
    return None


def private_torch_uses(path: Path) -> dict[str, int]:
    """`torch._x...` attribute chains and imports of private torch modules in one file, each with the line of its
    first use (the longest chain counts, cut after its first private part: `torch._dynamo.config.patch` is one use,
    `torch._dynamo`)."""
    found: dict[str, int] = {}
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        uses: list[str] = []
        if isinstance(node, ast.Import):
            uses = [a.name for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _private(node.module):
                uses = [node.module]
            elif node.module.split(".")[0] == "torch":  # `from torch import _C`, `from torch.utils import _pytree`
                uses = [f"{node.module}.{a.name}" for a in node.names if _private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            dotted = _dotted(node)
            if dotted is not None and _private(dotted):
                parts = dotted.split(".")
                first = next(i for i, p in enumerate(parts) if i and p.startswith("_") and not p.startswith("__"))
                uses = [".".join(parts[: first + 1])]
        for use in uses:
            found.setdefault(use, node.lineno)  # type: ignore[attr-defined]
    return found


def test_the_scan_finds_each_kind_of_private_use(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch._dynamo\nfrom torch._guards import tracing\nimport torch.nn\n"
        "x = torch._dynamo.config.patch(a=1)\ny = torch.ops.aten._int_mm\nz = torch.__version__\n"
        "from torch.utils import _pytree\n"
    )
    assert private_torch_uses(sample) == {
        "torch._dynamo": 1,
        "torch._guards": 2,
        "torch.ops.aten._int_mm": 5,
        "torch.utils._pytree": 7,
    }


def test_no_private_torch_outside_the_door() -> None:
    wrong = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == DOOR:
                continue
            rel = path.relative_to(ROOT)
            wrong += [f"{rel}:{line}: {use}" for use, line in sorted(private_torch_uses(path).items())]
    assert not wrong, "private torch APIs outside base/torch_compat.py (add them to the door):\n" + "\n".join(wrong)


def test_this_torch_passes_and_the_range_is_stated_once() -> None:
    assert torch_compat.check_runtime().ok, torch_compat.check_runtime().reason
    assert torch_compat.check_compiler().ok, torch_compat.check_compiler().reason
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"torch{SUPPORTED_RANGE}"' in pyproject
    assert f"torch{SUPPORTED_RANGE}" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    ("version", "problem"),
    [
        ("2.4.1", f"torch 2.4.1 is outside the supported range {SUPPORTED_RANGE}"),
        ("2.10.0", f"torch 2.10.0 is outside the supported range {SUPPORTED_RANGE}"),
        ("2.14.0a0+git1234", f"torch 2.14.0a0+git1234 is outside the supported range {SUPPORTED_RANGE}"),
        ("2.14.1", f"torch 2.14.1 is outside the supported range {SUPPORTED_RANGE}"),
        ("2.11.0", None),
        ("2.12.0", None),
        ("2.13.0+cpu", None),
    ],
)
def test_the_version_range(version: str, problem: str | None) -> None:
    assert torch_compat._version_problem(version) == problem


def test_a_missing_or_changed_internal_is_named() -> None:
    assert torch_compat._problems({"x": _Need("torch._dynamo.utils:no_such_name")}) == (
        "torch._dynamo.utils.no_such_name is missing"
    )
    assert torch_compat._problems({"x": _Need("torch._no_such_module")}) == "torch._no_such_module is missing"
    assert torch_compat._problems({"x": _Need("torch._dynamo.package:SourceInfo", keywords=("renamed",))}) == (
        "torch._dynamo.package.SourceInfo takes no 'renamed' argument"
    )
    assert torch_compat._problems({"x": _Need("torch._dynamo.package:load_guards_state", positional=2)}) == (
        "torch._dynamo.package.load_guards_state takes 1 positional arguments, glowplug passes 2"
    )
    assert torch_compat._problems({"x": _Need("torch._inductor.config", options=("cpp.no_such_option",))}) == (
        "torch._inductor.config has no option 'cpp.no_such_option'"
    )
    assert torch_compat._problems({"x": _Need("torch._dynamo.convert_frame:CaptureOutput", attrs=("gone",))}) == (
        "torch._dynamo.convert_frame.CaptureOutput has no 'gone'"
    )


def test_a_failed_check_closes_the_door(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAIL_ENV, "simulated: torch._dynamo.aot_compile is gone")
    torch_compat.check_runtime.cache_clear()
    torch_compat.check_compiler.cache_clear()
    try:
        for check in (torch_compat.check_runtime, torch_compat.check_compiler):
            verdict = check()
            assert (
                not verdict.ok and verdict.reason == f"simulated: torch._dynamo.aot_compile is gone ({FAIL_ENV} is set)"
            )
        for name in ("tensor_data_ptr_address", "fullgraph_capture"):
            with pytest.raises(TorchInternalsUnavailable, match="aot_compile is gone"):
                torch_compat.__getattr__(name)
    finally:
        monkeypatch.delenv(FAIL_ENV)
        torch_compat.check_runtime.cache_clear()
        torch_compat.check_compiler.cache_clear()
    assert torch_compat.check_compiler().ok


def test_config_options_must_be_declared() -> None:
    with pytest.raises(KeyError, match="declare the option"):
        torch_compat.patch_config("inductor", {"max_autotune_gemm": True})


# ------------------------------------------------------------------ whole starts, as a user runs them


def _startup(
    model: Path, tmp_path: Path, compile_mode: str, env: dict[str, str], tag: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, object] | None]:
    report = tmp_path / f"{tag}.json"
    # Not from the repository root: there `glowplug` would be the source folder, not the installed package.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "glowplug.cli",
            "startup",
            str(model),
            "--compile",
            compile_mode,
            "--max-num-seqs",
            "4",
            "--report-out",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    return proc, json.loads(report.read_text()) if report.is_file() else None


def _failed_line(proc: subprocess.CompletedProcess[str]) -> str:
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("glowplug: state FAILED")]
    return line


@pytest.mark.slow  # the native kernels build in the empty cache (~50 s on the 2-core box)
def test_a_torch_that_fails_the_check_runs_eagerly_under_auto_and_fails_on(tiny_dir, tmp_path: Path) -> None:
    reason = "simulated: torch._dynamo.aot_compile.AOTCompiledFunction is missing"
    env = {**os.environ, FAIL_ENV: reason, "GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")}
    proc, report = _startup(tiny_dir("llama"), tmp_path, "auto", env, "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "glowplug: READY" in proc.stderr and report is not None
    reasons = report["reasons"]
    for row in ("dynamo_transform_time", "graph_compile_general_shape", "graph_compile_cached", "graph_capturing"):
        assert reason in reasons[row] and reasons[row].startswith("eager: torch internals unavailable"), (row, reasons)
    assert not (tmp_path / "cache" / "compile").exists(), "nothing was compiled or stored"

    proc, _ = _startup(tiny_dir("llama"), tmp_path, "on", env, "on")
    assert proc.returncode == 1
    line = _failed_line(proc)
    assert "dynamo_transform" in line and "--compile on cannot compile the decode step" in line and reason in line


@pytest.mark.slow  # Dynamo traces, and Inductor gets as far as its C++ compiler
def test_no_cxx_compiler_runs_eagerly_under_auto_and_fails_on(tiny_dir, tmp_path: Path) -> None:
    """No C++ compiler: CXX names none, and the PATH holds only python. The native kernels load the install's
    prebuilt variant (`glowplug kernels build` in scripts/setup.sh; without one they skip, saying so); Inductor fails
    with InvalidCxxCompiler, which under auto leaves the step eager with the reason on the rows, without moving the
    Inductor folder aside (no cached file is to blame)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bin_dir), "CXX": "/nonexistent/c++", "GLOWPLUG_CACHE_DIR": str(tmp_path / "cache")}
    proc, report = _startup(tiny_dir("llama"), tmp_path, "auto", env, "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "glowplug: READY" in proc.stderr and report is not None
    reasons = report["reasons"]
    if "native_kernels" in reasons:  # an install without prebuilt variants: nothing here could build one
        assert "no C++ compiler" in reasons["native_kernels"] and "no prebuilt variant" in reasons["native_kernels"]
    else:
        assert report["attributes"]["native_kernels"]["glowplug.native_build"] == "prebuilt"
    assert report["phases"]["dynamo_transform_time"] > 0 and "dynamo_transform_time" not in reasons  # it traced
    for row in ("graph_compile_general_shape", "graph_compile_cached", "graph_capturing"):
        assert (
            reasons[row].startswith("eager: the decode step did not compile") and "InvalidCxxCompiler" in reasons[row]
        )
    assert not (tmp_path / "cache" / ".quarantine").exists(), "no cache folder was moved aside"

    proc, _ = _startup(tiny_dir("llama"), tmp_path, "on", env, "on")
    assert proc.returncode == 1
    line = _failed_line(proc)
    assert "graph_compile" in line and "InvalidCxxCompiler" in line
