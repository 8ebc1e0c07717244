"""Triton kernels vs the reference, on CPU through TRITON_INTERPRET=1, in one child process per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from child_cases import load_cases

from glowplug.kernels import triton as triton_pkg

if not triton_pkg.available():
    pytest.skip("triton not installed", allow_module_level=True)

_SCRIPT = Path(__file__).with_name("triton_cases.py")


_CASES = load_cases(_SCRIPT, "glowplug_triton_cases")


@pytest.fixture(scope="module")
def triton_results() -> dict[str, dict[str, Any]]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(_SCRIPT)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"triton case runner failed:\n{proc.stderr[-4000:]}"
    results: dict[str, dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("case", _CASES.case_ids())
def test_triton_kernel_matches_reference(case: str, triton_results: dict[str, dict[str, Any]]) -> None:
    res = triton_results[case]
    assert "error" not in res, res.get("error")
    assert res["dtype"] == "torch.float32"
    # fp32 throughout in the interpreter: only summation order differs from the oracle.
    assert res["max_rel"] < 1e-4 and res["fro_rel"] < 1e-5, res


def test_triton_dispatch_entry_runs_under_interpreter(triton_results: dict[str, dict[str, Any]]) -> None:
    res = triton_results["dispatch-entry"]
    assert res["supports"] is True
    assert res["max_rel"] < 1e-4
