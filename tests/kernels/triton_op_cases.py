"""The Triton decode ops (kernels/triton/graph_ops.py) against the torch reference, and traced with a symbolic batch.

Run as a script with TRITON_INTERPRET=1 (tests/kernels/test_triton_graph_ops.py starts it in a child process, as
test_kernels_triton.py does: triton reads the variable when its kernels are defined, so it must be set before anything
imports triton), or imported and called with device "cuda" by the GPU tests. Prints {case: result} as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

# (format spec, N, K): N = 72 leaves a partial tile of the production BLOCK_N (64) and K a partial BLOCK_K tile
# (GEMV 128, GEMM 64: 160 = 128 + 32 = 2 * 64 + 32, 200 = 128 + 72 = 3 * 64 + 8) after one or more full ones.
SHAPES: tuple[tuple[str, int, int], ...] = (
    ("int8", 72, 200),
    ("int8-g32", 72, 160),
    ("int4-g32", 72, 160),
    ("int4s-g32", 72, 160),
    ("int2-g32", 72, 160),
    ("w8a8", 72, 200),
)
# Both sides of ops.GEMV_MAX_M (8): the op takes GEMV up to it and GEMM beyond, inside one graph.
MS: tuple[int, ...] = (1, 8, 9, 17)
TRACE_MS: tuple[int, ...] = (3, 17, 5)  # batch 1 is specialised by Dynamo's dynamic=True, so the trace starts at 3


def case_ids() -> list[str]:
    ops = [f"op-{spec}-{n}x{k}-M{m}" for spec, n, k in SHAPES for m in MS]
    return ops + [f"trace-{spec}" for spec, _, _ in SHAPES] + ["bf16-out", "skipped-reason", "stage"]


def _weight(spec: str, n: int, k: int, device: str) -> Any:
    import torch

    from glowplug.kernels import formats as F

    gen = torch.Generator().manual_seed(n * k + len(spec))
    w = torch.randn(n, k, generator=gen) * 0.05
    packed = (
        F.quantize_w8a8(w, torch.rand(k, generator=gen) + 0.5)
        if spec == "w8a8"  # smoothing: the 1/s path
        else F.quantize(w, spec)
    )
    if device == "cpu":
        return packed
    return dataclasses.replace(
        packed,
        **{
            f.name: getattr(packed, f.name).to(device)
            for f in dataclasses.fields(packed)
            if isinstance(getattr(packed, f.name), torch.Tensor)
        },
    )


def _rel(y: Any, ref: Any) -> dict[str, float]:
    diff = (y.float() - ref).abs()
    return {"max_rel": float(diff.max() / ref.abs().max()), "fro_rel": float((y.float() - ref).norm() / ref.norm())}


def op_cases(device: str) -> dict[str, dict[str, Any]]:
    """Each op call against reference.linear, and against the launcher the op should have chosen at that M."""
    import torch

    from glowplug.kernels import reference as R
    from glowplug.kernels.triton import graph_ops, ops

    graph_ops.register()
    out: dict[str, dict[str, Any]] = {}
    for spec, n, k in SHAPES:
        w = _weight(spec, n, k, device)
        st = ops.prepare(w)
        op, tensors = graph_ops.decode_op(st)
        gen = torch.Generator().manual_seed(k)
        for m in MS:
            cid = f"op-{spec}-{n}x{k}-M{m}"
            try:
                x = torch.randn(m, k, generator=gen).to(device)
                y = graph_ops.linear(x, op, tensors)
                launcher = ops.gemv if m <= ops.GEMV_MAX_M else ops.gemm
                out[cid] = {
                    **_rel(y, R.linear(x, w)),
                    "dtype": str(y.dtype),
                    "shape": list(y.shape),
                    "as_launcher": bool(torch.equal(y, launcher(x, st))),
                }
            except Exception:  # noqa: BLE001 - reported per case so one broken op does not hide the others
                out[cid] = {"error": traceback.format_exc()}
    return out


def trace_cases(device: str) -> dict[str, dict[str, Any]]:
    """A QuantLinear switched to the Triton op, compiled with a symbolic batch: one graph for every M, holding the op
    as one node, whose outputs equal the same layer run eagerly through the op (and the reference)."""
    import torch

    from glowplug.kernels import reference as R
    from glowplug.kernels.modules import DecodeKernel, QuantLinear, native_kernels_in_eager

    out: dict[str, dict[str, Any]] = {}
    for spec, n, k in SHAPES:
        cid = f"trace-{spec}"
        try:
            torch.compiler.reset()  # a fresh count towards the recompile limit (see gpu_cases)
            w = _weight(spec, n, k, device)
            bias = torch.linspace(-1, 1, n, device=device)
            mod = QuantLinear.from_packed(w, bias)
            switch = mod.enable_triton()
            graphs: list[Any] = []

            def count(gm: torch.fx.GraphModule, example: list[torch.Tensor], graphs: list[Any] = graphs) -> Any:
                graphs.append(gm)
                return gm

            compiled = torch.compile(mod, backend=count, dynamic=True, fullgraph=True)
            gen = torch.Generator().manual_seed(n)
            res: dict[str, Any] = {
                "switched": switch.switched,
                "kernel": mod.kernel is DecodeKernel.TRITON,
                "nbytes": switch.nbytes,
                "equal_eager": [],
                "max_rel": 0.0,
            }
            for m in TRACE_MS:
                x = torch.randn(m, k, generator=gen).to(device)
                with torch.inference_mode():
                    y = compiled(x)
                    with native_kernels_in_eager():
                        eager = mod(x)
                res["equal_eager"].append(bool(torch.equal(y, eager)))
                res["max_rel"] = max(res["max_rel"], _rel(y, R.linear(x, w, bias))["max_rel"])
            g = graphs[0].graph
            calls = [str(nd.target) for nd in g.nodes if nd.op in ("call_function", "call_method")]
            ops_nodes = [nd for nd in g.nodes if "glowplug_triton" in str(nd.target)]
            res.update(
                graphs=len(graphs),
                calls=calls,
                triton_nodes=len(ops_nodes),
                symbolic=[not isinstance(nd.meta["example_value"].shape[0], int) for nd in ops_nodes],
                fake_dtype=[str(nd.meta["example_value"].dtype) for nd in ops_nodes],
            )
            out[cid] = res
        except Exception:  # noqa: BLE001
            out[cid] = {"error": traceback.format_exc()}
    return out


def gpu_cases() -> dict[str, dict[str, Any]]:
    """CUDA only: each layer compiled by Inductor with a symbolic batch, and captured in a CUDA graph (the decode
    step's graphs hold these ops), against the same layer run eagerly through the op."""
    import torch

    from glowplug.kernels.modules import QuantLinear, native_kernels_in_eager

    out: dict[str, dict[str, Any]] = {}
    for spec, n, k in SHAPES:
        cid = f"gpu-{spec}"
        try:
            # Each case compiles QuantLinear.forward afresh: without a reset, the cases before it count towards
            # Dynamo's recompile limit (a new module is a recompile), which fullgraph=True turns into a failure.
            torch.compiler.reset()
            mod = QuantLinear.from_packed(_weight(spec, n, k, "cuda"), torch.linspace(-1, 1, n, device="cuda"))
            mod.enable_triton()
            compiled = torch.compile(mod, dynamic=True, fullgraph=True)
            res: dict[str, Any] = {"inductor_rel": 0.0, "graph_rel": 0.0}
            for m in TRACE_MS:
                x = torch.randn(m, k, device="cuda")
                with torch.inference_mode():
                    with native_kernels_in_eager():
                        eager = mod(x)
                    y = compiled(x)
                    static = x.clone()
                    with native_kernels_in_eager():
                        mod(static)  # warm-up: the launchers compile outside the capture
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            captured = mod(static)
                    static.copy_(x)
                    graph.replay()
                    torch.cuda.synchronize()
                scale = float(eager.abs().max())
                res["inductor_rel"] = max(res["inductor_rel"], float((y - eager).abs().max()) / scale)
                res["graph_rel"] = max(res["graph_rel"], float((captured - eager).abs().max()) / scale)
            out[cid] = res
        except Exception:  # noqa: BLE001
            out[cid] = {"error": traceback.format_exc()}
    return out


def bf16_case(device: str) -> dict[str, Any]:
    """bf16 activations: the op (and its fake) write bf16, GEMV and GEMM alike."""
    import torch

    from glowplug.kernels import reference as R
    from glowplug.kernels.triton import graph_ops, ops

    w = _weight("int4-g32", 72, 160, device)
    op, tensors = graph_ops.decode_op(ops.prepare(w))
    res: dict[str, Any] = {}
    for m in (1, 17):
        x = torch.randn(m, 160).to(device).bfloat16()
        y = graph_ops.linear(x, op, tensors)
        res[f"M{m}"] = {
            "dtype": str(y.dtype),
            "fake": str(graph_ops._wq_fake(x, *tensors, *op.ints).dtype),  # noqa: SLF001
            **_rel(y, R.linear(x, w)),
        }
    return res


def skipped_reason_case() -> dict[str, Any]:
    """dynamo_transform's skipped_reason: a model whose quantized layers are switched to the Triton op compiles; before
    the switch it says why not."""
    from types import SimpleNamespace

    import torch

    from glowplug.engine.stages.dynamo_transform import skipped_reason
    from glowplug.kernels.modules import DenseLinear, QuantLinear, enable_triton_decode

    model = torch.nn.Sequential(
        QuantLinear.from_packed(_weight("int4-g32", 72, 160, "cpu")),
        QuantLinear.from_packed(_weight("w8a8", 72, 200, "cpu")),
        DenseLinear(8, 8),
    )
    ctx = SimpleNamespace(config=SimpleNamespace(compile_enabled=lambda: True), model=model, device="cpu", native=None)
    before = skipped_reason(ctx, None)  # type: ignore[arg-type]
    counts = enable_triton_decode(model)
    return {"before": before, "after": skipped_reason(ctx, None), "counts": counts}  # type: ignore[arg-type]


def _op_sites(gm: Any) -> int:
    """How many glowplug_triton op calls one run of the graph makes: Dynamo traces the repeated layers as one nested
    region (invoke_subgraph), so a region's ops count once per call of it."""
    n = 0
    for nd in gm.graph.nodes:
        if nd.op != "call_function":
            continue
        if "glowplug_triton" in str(nd.target):
            n += 1
        elif "invoke_subgraph" in str(nd.target):
            n += _op_sites(getattr(gm, nd.args[0].target))
    return n


def stage_case() -> dict[str, Any]:
    """The native_kernels stage on a CUDA start (here: device "cuda" in the context, the layers on the CPU, where the
    interpreter runs the kernels): what it reports once the quantized layers switched."""
    from types import SimpleNamespace

    import torch

    from glowplug.engine.stages.native_kernels import NativeKernels
    from glowplug.kernels.modules import DecodeKernel, DenseLinear, QuantLinear

    model = torch.nn.Sequential(
        QuantLinear.from_packed(_weight("int4-g32", 72, 160, "cpu")),
        QuantLinear.from_packed(_weight("w8a8", 72, 200, "cpu")),
        DenseLinear(8, 8),
    )
    ctx = SimpleNamespace(
        config=SimpleNamespace(compile_enabled=lambda: True), model=model, device="cuda", need=lambda value, *_: value
    )
    report = NativeKernels().run(ctx)  # type: ignore[arg-type]
    return {
        "skipped": report.skipped_reason,
        "attributes": dict(report.attributes),
        "kernels": [m.kernel is DecodeKernel.TRITON for m in model if isinstance(m, QuantLinear)],
    }


def decode_step_case(tmp: Path) -> dict[str, Any]:
    """The whole decode step of a tiny int4 model with its quantized layers on the Triton op, traced with the
    engine's unbacked batch (engine.compile.mark_decode_dynamic): one graph for batches 2 and 5, one op node per
    quantized layer, and the logits of the eager step through the same ops."""
    import torch

    from glowplug.engine.compile import decode_step, mark_decode_dynamic, split_caches
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.kv_cache import KVCache
    from glowplug.engine.model_runner import dummy_decode_batch
    from glowplug.engine.models.tiny import make_tiny_checkpoint
    from glowplug.engine.startup import build_engine
    from glowplug.kernels.modules import QuantLinear, enable_triton_decode, native_kernels_in_eager

    folder = make_tiny_checkpoint(tmp / "tiny", "llama")
    cfg = EngineConfig.from_flat(model=str(folder), compile="off", quantization="int4", group_size=32)
    model = build_engine(cfg, cache_dir=tmp / "cache").engine.model
    counts = enable_triton_decode(model)
    arch = model.arch
    cache = KVCache(
        num_layers=arch.num_hidden_layers,
        num_blocks=6,
        block_size=16,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        dtype=torch.float32,
    )
    graphs: list[torch.fx.GraphModule] = []

    def count(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return gm

    compiled = torch.compile(decode_step, backend=count, fullgraph=True)
    equal = []
    for batch in (2, 5):
        packed = dummy_decode_batch(batch, 3, cache.block_size, "cpu")
        packed[:, 0] = torch.arange(batch) + 5  # different tokens per row
        with torch.inference_mode():
            with native_kernels_in_eager():
                eager = model.decode(packed, cache.layers)
            mark_decode_dynamic(packed, cache.layers)
            got = compiled(model, packed, *split_caches(cache.layers))
        equal.append(bool(torch.equal(got, eager)))
    sites = _op_sites(graphs[0])
    quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    return {"graphs": len(graphs), "op_sites": sites, "quantized": quant, "counts": counts, "equal_eager": equal}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("TRITON_INTERPRET=1 must be set before launching this script", file=sys.stderr)
        return 2
    results: dict[str, Any] = {**op_cases("cpu"), **trace_cases("cpu")}
    for name, fn in (
        ("bf16-out", lambda: bf16_case("cpu")),
        ("skipped-reason", skipped_reason_case),
        ("stage", stage_case),
    ):
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc()}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            results["decode-step"] = decode_step_case(Path(tmp))
        except Exception:  # noqa: BLE001
            results["decode-step"] = {"error": traceback.format_exc()}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
