"""transformers, accelerate and matplotlib are extras (`test`, `bench`), not runtime dependencies: the engine starts
and generates in a process that cannot import them (tests/without_extras.py refuses them), and a command that does
need them names the extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).with_name("without_extras.py")


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(LAUNCHER), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("module", ["transformers", "accelerate", "matplotlib"])
def test_the_launcher_refuses_the_extras(module: str) -> None:
    """The guard itself: without it the tests below would pass in any environment that has the extras."""
    proc = _run(module)
    assert proc.returncode != 0 and "refused by tests/without_extras.py" in proc.stderr, proc.stderr


def test_bench_decode_names_the_extra_its_transformers_peer_needs() -> None:
    proc = _run("glowplug.cli", "bench", "decode")
    assert proc.returncode == 2, proc.stderr
    assert "bench decode's transformers peer" in proc.stderr and "pip install glowplug[bench]" in proc.stderr


def test_a_bench_report_with_charts_names_the_extra_before_any_work() -> None:
    proc = _run("glowplug.cli", "bench", "latency", "--out-dir", "/nonexistent/never-written")
    assert proc.returncode == 2, proc.stderr
    assert "the report's charts (--no-plots leaves them out) needs matplotlib" in proc.stderr
    assert "pip install glowplug[bench]" in proc.stderr


@pytest.mark.slow
def test_default_model_starts_and_generates_without_transformers_or_accelerate() -> None:
    """The default model (a GGUF) from preparation to READY and a greedy completion, eager (`--compile off`)."""
    proc = _run(
        "glowplug.cli", "generate", "The capital of France is", "--compile", "off", "--max-tokens", "4", timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("The capital of France is Paris"), proc.stdout
