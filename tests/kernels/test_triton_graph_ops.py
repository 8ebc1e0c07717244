"""The Triton decode ops (kernels/triton/graph_ops.py): each against the torch reference over shapes with tails, on
both sides of the GEMV/GEMM split, and traced with a symbolic batch as one node per layer (a QuantLinear, and the
whole decode step of a tiny int4 model), on the CPU under TRITON_INTERPRET=1 in one child process
(triton_op_cases.py); the same on a GPU where there is one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from child_cases import load_cases

from glowplug.kernels import triton as triton_pkg

if not triton_pkg.available():
    pytest.skip("triton not installed", allow_module_level=True)

_SCRIPT = Path(__file__).with_name("triton_op_cases.py")


_CASES = load_cases(_SCRIPT, "glowplug_triton_op_cases")
_OP_IDS = [c for c in _CASES.case_ids() if c.startswith("op-")]
_TRACE_IDS = [c for c in _CASES.case_ids() if c.startswith("trace-")]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(_SCRIPT)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"triton op case runner failed:\n{proc.stderr[-4000:]}"
    out: dict[str, dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _check_op(res: dict[str, Any], m: int, gemm_tol: float) -> None:
    assert "error" not in res, res.get("error")
    assert res["as_launcher"], "the op did not run the launcher its row count calls for (GEMV up to GEMV_MAX_M)"
    assert res["dtype"] == "torch.float32" and res["shape"][0] == m
    tol = gemm_tol if m > 8 else 1e-4
    assert res["max_rel"] < tol and res["fro_rel"] < tol / 5, res


@pytest.mark.parametrize("case", _OP_IDS)
def test_op_matches_reference(case: str, results: dict[str, dict[str, Any]]) -> None:
    # fp32 throughout in the interpreter: only the summation order differs from the oracle.
    _check_op(results[case], int(case.rsplit("-M", 1)[1]), 1e-4)


def _check_trace(res: dict[str, Any], tol: float) -> None:
    assert "error" not in res, res.get("error")
    assert res["switched"] and res["kernel"] and res["nbytes"] > 0
    assert res["graphs"] == 1, "a new batch size recompiled the layer"
    assert res["triton_nodes"] == 1 and res["symbolic"] == [True], res["calls"]
    assert res["fake_dtype"] == ["torch.float32"]
    assert all(res["equal_eager"]), "the traced layer differs from the same layer run eagerly through the op"
    assert res["max_rel"] < tol


@pytest.mark.parametrize("case", _TRACE_IDS)
def test_switched_layer_traces_with_a_symbolic_batch(case: str, results: dict[str, dict[str, Any]]) -> None:
    _check_trace(results[case], 1e-4)


def test_bf16_activations_give_bf16_outputs(results: dict[str, dict[str, Any]]) -> None:
    res = results["bf16-out"]
    assert "error" not in res, res.get("error")
    for m in ("M1", "M17"):
        assert res[m]["dtype"] == res[m]["fake"] == "torch.bfloat16"
        assert res[m]["max_rel"] < 2e-2  # the output rounded to bf16 (8 bits of mantissa)


def test_triton_layers_lift_the_compile_skip(results: dict[str, dict[str, Any]]) -> None:
    res = results["skipped-reason"]
    assert "error" not in res, res.get("error")
    assert res["before"].startswith("eager: 2 quantized layers have no native decode kernel")
    assert res["after"] is None
    assert res["counts"]["quantized"] == res["counts"]["switched"] == 2


def test_cuda_native_kernels_stage_switches_the_quantized_layers(results: dict[str, dict[str, Any]]) -> None:
    from glowplug.profiling.names import Attr

    res = results["stage"]
    assert "error" not in res, res.get("error")
    assert res["skipped"] is None and res["kernels"] == [True, True]
    attrs = res["attributes"]
    assert attrs[Attr.TRITON_DECODE_LAYERS] == 2 and attrs[Attr.BYTES_PER_TOKEN] > 0
    # The row also names the decode attention the start runs (the stage asks on CUDA).
    assert attrs[Attr.ROW_NOTE].startswith("Triton GEMV/GEMM ops for 2 quantized layers; decode attention: ")


def test_cuda_native_kernels_stage_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels cannot run on the layers' device, the stage's row says why and nothing switches; a dense
    model has nothing to switch."""
    from types import SimpleNamespace

    from glowplug.engine.stages.native_kernels import NativeKernels
    from glowplug.kernels import formats as F
    from glowplug.kernels.modules import DecodeKernel, DenseLinear, QuantLinear
    from glowplug.profiling.names import Attr

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layers = [QuantLinear.from_packed(F.quantize(torch.randn(8, 64), "int4-g32")) for _ in range(3)]

    def run(model: torch.nn.Module) -> Any:
        ctx = SimpleNamespace(
            config=SimpleNamespace(compile_enabled=lambda: True),
            model=model,
            device="cuda",
            need=lambda value, *_: value,
        )
        return NativeKernels().run(ctx)  # type: ignore[arg-type]

    report = run(torch.nn.Sequential(*layers, DenseLinear(8, 8)))
    why = "Triton kernels run on CUDA tensors (device cpu; TRITON_INTERPRET=1 runs them on the CPU)"
    assert report.skipped_reason.startswith(f"Triton decode kernels unavailable: 3 layers: {why}; decode attention: ")
    assert report.attributes[Attr.TRITON_DECODE_LAYERS] == 0
    assert all(m.kernel is DecodeKernel.STOCK for m in layers)
    assert run(torch.nn.Sequential(DenseLinear(8, 8))).skipped_reason.startswith("no quantized layers")


def test_quantized_decode_step_traces_with_the_ops(results: dict[str, dict[str, Any]]) -> None:
    res = results["decode-step"]
    assert "error" not in res, res.get("error")
    assert res["graphs"] == 1, "batch 5 recompiled the step traced at batch 2"
    assert res["op_sites"] == res["quantized"] == res["counts"]["switched"] > 0
    assert all(res["equal_eager"])


def test_cuda_without_triton_kernels_names_the_reason() -> None:
    """On a CUDA start whose quantized layers could not switch, dynamo_transform says why it stays eager."""
    from types import SimpleNamespace

    from glowplug.engine.stages.dynamo_transform import skipped_reason
    from glowplug.kernels import formats as F
    from glowplug.kernels.modules import QuantLinear
    from glowplug.kernels.triton.ops import unsupported_reason

    model = torch.nn.Sequential(QuantLinear.from_packed(F.quantize(torch.randn(8, 64), "int4-g32")))
    ctx = SimpleNamespace(config=SimpleNamespace(compile_enabled=lambda: True), model=model, device="cuda", native=None)
    why = unsupported_reason("cuda") or "the native_kernels stage did not switch them"  # the latter on a GPU
    assert skipped_reason(ctx, None) == f"eager: 1 quantized layers have no Triton decode kernel ({why})"  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        assert unsupported_reason("cuda") == "CUDA is not available"


# ------------------------------------------------------------------------------------------------------ on a GPU
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
    reason="needs a CUDA GPU of compute capability 8.0 or newer",
)


@pytest.mark.cuda
@needs_gpu
def test_ops_on_gpu_match_reference() -> None:
    got = _CASES.op_cases("cuda")
    for case in _OP_IDS:
        # GEMM rows: fp32 operands through TF32 tensor cores (10-bit mantissa); w8a8 is integer arithmetic.
        _check_op(got[case], int(case.rsplit("-M", 1)[1]), 1e-4 if "w8a8" in case else 5e-3)
    bf16 = _CASES.bf16_case("cuda")
    assert all(bf16[m]["dtype"] == bf16[m]["fake"] == "torch.bfloat16" and bf16[m]["max_rel"] < 2e-2 for m in bf16)


@pytest.mark.cuda
@needs_gpu
def test_switched_layers_on_gpu_trace_compile_and_capture() -> None:
    traced = _CASES.trace_cases("cuda")
    for case in _TRACE_IDS:
        _check_trace(traced[case], 5e-3)
    for case, res in _CASES.gpu_cases().items():
        assert "error" not in res, (case, res.get("error"))
        assert res["inductor_rel"] < 1e-5 and res["graph_rel"] == 0.0, (case, res)
