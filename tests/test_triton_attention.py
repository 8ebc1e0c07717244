"""The Triton paged decode attention kernel (kernels/triton/attention.py) against its torch reference
(kernels/reference.py paged_decode_attention_reference), and its wiring into engine/attention.py.

Triton picks its interpreter when a kernel is defined (triton 3.9 reads TRITON_INTERPRET in @triton.jit), so the
kernels run in one child process started with TRITON_INTERPRET=1 (this file, run as a script): it launches every
case on CPU tensors and saves the inputs it used and the outputs it got; the tests here compute the reference from
those inputs and compare. Every slot a row must not see (past its context, before its window, the scratch block the
table is padded with) holds NaN (or a NaN scale in an int8 cache), so a kernel that read one would show it.

The CUDA tests at the end run only with a GPU (`pytest -m cuda`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from glowplug.kernels import triton as triton_pkg
from glowplug.kernels.formats import quantize_kv
from glowplug.kernels.reference import paged_decode_attention_reference
from glowplug.kernels.triton import attention as tri

needs_triton = pytest.mark.skipif(not triton_pkg.available(), reason="triton not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# name: (dtype, int8 cache, heads, kv heads, head_dim, block_size, table width W, context lengths, window,
#        partition, block_n). Small tiles (partition 16, block_n 16) make tiny shapes cover several loop steps and
#        partitions; (256, None) is the launcher's default: a single pass.
CASES: dict[str, tuple[Any, ...]] = {
    # 9 query heads over 3 KV heads (G=3 padded to 16 rows); contexts of 1 token, exactly one block, one past a
    # block boundary, a mid-block tail, and 0 (a row that sees nothing: zeros); 3 partitions of 16 tokens.
    "gqa9x3-fp32-split": (torch.float32, False, 9, 3, 32, 4, 10, [1, 4, 5, 23, 0, 40], None, 16, 16),
    # 4 heads over 1, head_dim 24 (not a power of 2: a masked tail of the head tile), bf16.
    "gqa4x1-bf16-split": (torch.bfloat16, False, 4, 1, 24, 4, 10, [3, 17, 40], None, 16, 16),
    "gqa4x1-fp16-single": (torch.float16, False, 4, 1, 24, 4, 10, [3, 17, 40], None, 256, None),
    # Rows of very different lengths over 4 partitions: most of the short rows' partitions do nothing.
    "ragged-fp32-split": (torch.float32, False, 4, 2, 16, 4, 16, [1, 2, 64, 33, 7], None, 16, 16),
    # Sliding window smaller than most contexts (it starts mid-block and mid-partition), and larger than all.
    "window6-fp32-split": (torch.float32, False, 6, 2, 16, 4, 12, [1, 6, 7, 30, 48], 6, 16, 16),
    "window64-fp32-split": (torch.float32, False, 6, 2, 16, 4, 12, [1, 6, 7, 30, 48], 64, 16, 16),
    "window5-bf16-single": (torch.bfloat16, False, 6, 2, 16, 8, 6, [2, 13, 48], 5, 256, None),
    # int8 caches with per-(slot, head) scales, with and without a window, in fp32 and bf16.
    "int8-fp32-split": (torch.float32, True, 6, 2, 16, 4, 10, [1, 9, 26, 40], None, 16, 16),
    "int8-bf16-window-split": (torch.bfloat16, True, 9, 3, 32, 4, 10, [3, 21, 40], 7, 16, 16),
    "int8-fp32-single": (torch.float32, True, 4, 4, 16, 8, 4, [5, 32], None, 256, None),
}


def _tolerance(dtype: torch.dtype) -> float:
    # The interpreter multiplies in fp32; what is left is the output's rounding to its dtype.
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def make_case(name: str, seed: int = 0) -> dict[str, Any]:
    """The inputs of one case: out-of-order, non-contiguous block ids per row, the table padded with the scratch
    block (the last), and NaN in every slot no row sees."""
    dtype, int8, heads, kv_heads, d, bs, width, ctx, window, partition, block_n = CASES[name]
    g = torch.Generator().manual_seed(seed)
    rows = len(ctx)
    needed = [-(-c // bs) for c in ctx]
    num_blocks = sum(needed) + 4  # a few blocks nobody owns, and the scratch block last
    scratch = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    tables = torch.full((rows, width), scratch, dtype=torch.long)
    visible = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for i, n in enumerate(needed):
        blocks = [order.pop() for _ in range(n)]
        tables[i, :n] = torch.tensor(blocks, dtype=torch.long)
        lo = max(ctx[i] - window, 0) if window is not None else 0
        for t in range(lo, ctx[i]):
            visible[blocks[t // bs] * bs + t % bs] = True
    k = torch.randn(num_blocks * bs, kv_heads, d, generator=g)
    v = torch.randn(num_blocks * bs, kv_heads, d, generator=g)
    q = torch.randn(rows, heads, d, generator=g).to(dtype)
    packed = torch.zeros(rows, tri.PACKED_TABLE + width, dtype=torch.long)
    packed[:, tri.PACKED_CONTEXT] = torch.tensor(ctx)
    packed[:, tri.PACKED_TABLE :] = tables
    shape = (num_blocks, bs, kv_heads, d)
    if int8:
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        ks[~visible], vs[~visible] = float("nan"), float("nan")
        caches = (kq.view(shape), vq.view(shape), ks.view(shape[:-1]), vs.view(shape[:-1]))
    else:
        k[~visible], v[~visible] = float("nan"), float("nan")
        caches = (k.to(dtype).view(shape), v.to(dtype).view(shape), None, None)
    return {
        "q": q,
        "k": caches[0],
        "v": caches[1],
        "k_scale": caches[2],
        "v_scale": caches[3],
        "packed": packed,
        "scale": d**-0.5,
        "window": window,
        "partition": partition,
        "block_n": block_n,
    }


def _reference(c: dict[str, Any]) -> torch.Tensor:
    return paged_decode_attention_reference(
        c["q"], c["k"], c["v"], c["k_scale"], c["v_scale"], c["packed"], c["scale"], c["window"]
    )


# ------------------------------------------------------------------------------------------- the child process
def _engine_cases() -> dict[str, dict[str, Any]]:
    """engine/attention.py with the Triton path forced on for CPU tensors: the compiled decode step's attention
    (through the custom op, traced with fullgraph) and the eager path's decode rows (through the launcher)."""
    from glowplug.engine import attention as ea
    from glowplug.engine.kv_cache import KVCache

    ea._use_triton = lambda t: True  # the seam: CPU tensors under the interpreter stand in for CUDA ones
    tri.register_op()
    out: dict[str, dict[str, Any]] = {}
    for int8 in (False, True):
        c = make_case("gqa9x3-fp32-split" if not int8 else "int8-fp32-split", seed=1)
        b, _, d = c["q"].shape
        kv_heads = c["k"].shape[2]
        g = torch.Generator().manual_seed(2)
        knew, vnew = torch.randn(b, kv_heads, d, generator=g), torch.randn(b, kv_heads, d, generator=g)
        packed, cache = c["packed"].clone(), ea.LayerKV(c["k"], c["v"], c["k_scale"], c["v_scale"])
        # The new token's slot: the last position of each row's context (a row of context 0 writes the scratch).
        bs = c["k"].shape[1]
        for i in range(b):
            pos = max(int(packed[i, ea.CONTEXT]) - 1, 0)
            packed[i, ea.SLOT] = packed[i, ea.DECODE_COLS + pos // bs] * bs + pos % bs
        step = torch.compile(ea.decode_attention, backend="eager", fullgraph=True)
        got = step(c["q"], knew, vnew, cache, packed, c["scale"], False, 6)
        out[f"engine-decode-{'int8' if int8 else 'fp32'}"] = {**c, "packed": packed, "window": 6, "out": got}
    # The eager path: one prefill chunk (2 tokens of a fresh sequence), then decode rows over scattered blocks.
    bs, kv_heads, d, heads = 4, 2, 16, 6
    kv = KVCache(num_layers=1, num_blocks=14, block_size=bs, num_kv_heads=kv_heads, head_dim=d, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    kv[0].k.copy_(torch.randn(kv[0].k.shape, generator=g))
    kv[0].v.copy_(torch.randn(kv[0].v.shape, generator=g))
    tables = torch.tensor([[5, 2, 9, 12], [7, 3, 13, 13], [0, 13, 13, 13]])  # block 13: the scratch
    ctx = torch.tensor([15, 6, 1])
    slots = torch.tensor([10 * bs, 10 * bs + 1, 12 * bs + 2, 3 * bs + 1, 0])
    meta = ea.AttentionMetadata(
        prefill_info=torch.tensor([[0, 2, 2]]),
        prefill_block_tables=torch.tensor([[10]]),
        kv_cache=kv,
        slot_mapping=slots,
        decode_block_tables=tables,
        decode_ctx_lens=ctx,
    )
    q = torch.randn(5, heads, d, generator=g)
    knew, vnew = torch.randn(5, kv_heads, d, generator=g), torch.randn(5, kv_heads, d, generator=g)
    got = ea.paged_attention(q, knew, vnew, 0, meta, d**-0.5, window=8)
    packed = torch.cat([torch.zeros(3, 3, dtype=torch.long), ctx[:, None], tables], 1)
    out["engine-eager"] = {
        "q": q[2:],
        "k": kv[0].k,
        "v": kv[0].v,
        "k_scale": None,
        "v_scale": None,
        "packed": packed,
        "scale": d**-0.5,
        "window": 8,
        "out": got[2:],
    }
    return out


# (q dtype, int8 cache, G, head_dim, split): the variants compiled for a GPU target below.
GPU_VARIANTS = (
    ("bf16", False, 3, 64, True),
    ("fp16", True, 8, 128, False),
    ("fp32", False, 1, 256, True),
    ("bf16", True, 4, 256, True),
)


def compile_for_gpu(arch: int) -> list[str]:
    """Compile the kernels down to a cubin for CUDA sm_`arch` without a GPU (Triton's own ptxas), at the tiles
    the launcher picks: what a GPU's first launch would compile. Returns one line per variant ("ok" or the
    error)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from glowplug.kernels.triton import attention_kernels as kern

    target = GPUTarget("cuda", arch, 32)
    strides = [n for n in kern.paged_decode_kernel.arg_names if n.startswith("stride_")]
    lines = []
    for qdt, int8, group, d, split in GPU_VARIANTS:
        cdt = "i8" if int8 else qdt
        sig = {
            "q_ptr": f"*{qdt}",
            "k_ptr": f"*{cdt}",
            "v_ptr": f"*{cdt}",
            "ks_ptr": "*fp32",
            "vs_ptr": "*fp32",
            "table_ptr": "*i64",
            "ctx_ptr": "*i64",
            "out_ptr": f"*{qdt}",
            "m_ptr": "*fp32",
            "l_ptr": "*fp32",
            "acc_ptr": "*fp32",
            "scale": "fp32",
            "window": "i32",
            "block_size": "i32",
            "partition": "i32",
            **dict.fromkeys(strides, "i32"),
        }
        block_d = max(tri.MIN_DOT, 1 << (d - 1).bit_length())
        const = {
            "G": group,
            "G_PAD": max(tri.MIN_DOT, 1 << (group - 1).bit_length()),
            "D": d,
            "BLOCK_D": block_d,
            "BLOCK_N": tri.default_block_n(block_d, int8 or qdt == "fp32"),
            "INT8": int8,
            "SPLIT": split,
            "DOT_F32": qdt == "fp32",
        }
        sig.update(dict.fromkeys(const, "constexpr"))
        name = f"sm{arch} {qdt}{' int8' if int8 else ''} G={group} D={d}{' split' if split else ''}"
        try:
            triton_compile(
                ASTSource(kern.paged_decode_kernel, sig, constexprs=const),
                target=target,
                options={"num_warps": 8 if qdt == "fp32" and block_d >= 128 else 4},
            )
            if split:
                csig = {
                    "ctx_ptr": "*i64",
                    "m_ptr": "*fp32",
                    "l_ptr": "*fp32",
                    "acc_ptr": "*fp32",
                    "out_ptr": f"*{qdt}",
                    "window": "i32",
                    "partition": "i32",
                    "D": "constexpr",
                    "BLOCK_D": "constexpr",
                    **{n: "i32" for n in kern.paged_decode_combine_kernel.arg_names if n.startswith("stride_")},
                }
                triton_compile(
                    ASTSource(kern.paged_decode_combine_kernel, csig, constexprs={"D": d, "BLOCK_D": block_d}),
                    target=target,
                    options={"num_warps": 4},
                )
            lines.append(f"{name}: ok")
        except Exception as exc:  # noqa: BLE001 - reported per variant
            lines.append(f"{name}: {type(exc).__name__}: {exc}")
    return lines


def main(path: str) -> int:
    if path == "--compile":
        print("\n".join(compile_for_gpu(80)))
        return 0
    if not triton_pkg.interpreting():
        print("TRITON_INTERPRET=1 must be set before this script starts", file=sys.stderr)
        return 2
    results: dict[str, dict[str, Any]] = {}
    for name in CASES:
        c = make_case(name)
        c["out"] = tri.paged_decode_attention(
            c["q"],
            c["k"],
            c["v"],
            c["k_scale"],
            c["v_scale"],
            c["packed"][:, tri.PACKED_TABLE :],
            c["packed"][:, tri.PACKED_CONTEXT],
            c["scale"],
            c["window"],
            partition=c["partition"],
            block_n=c["block_n"],
        )
        results[name] = c
    # Through the custom op (the launcher's default tiles) as the compiled step calls it.
    c = make_case("gqa9x3-fp32-split", seed=4)
    op = tri.register_op()
    c["out"] = op(c["q"], c["k"], c["v"], None, None, c["packed"], c["scale"], 3)  # type: ignore[operator]
    c["window"] = 3
    results["op"] = c
    results.update(_engine_cases())
    torch.save(results, path)
    return 0


# ------------------------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    path = tmp_path_factory.mktemp("triton-attention") / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, __file__, str(path)], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"the interpreted kernels failed:\n{proc.stderr[-4000:]}"
    results: dict[str, dict[str, Any]] = torch.load(path, weights_only=False)
    return results


def _nvidia_backend() -> bool:
    if not triton_pkg.available():
        return False
    import importlib.util

    return importlib.util.find_spec("triton.backends.nvidia") is not None


@pytest.mark.skipif(not _nvidia_backend(), reason="triton without its NVIDIA backend")
def test_kernels_compile_for_an_ampere_gpu(tmp_path: Path) -> None:
    """The kernels through Triton's whole NVIDIA pipeline (TTIR, TTGIR, LLVM, PTX, ptxas) for sm_80, with no GPU:
    the interpreter runs the Python semantics only, this is the compiler a GPU's first launch would run."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, __file__, "--compile"], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(GPU_VARIANTS) and all(line.endswith(": ok") for line in lines), proc.stdout


def _check(c: dict[str, Any], dtype: torch.dtype | None = None) -> None:
    want = _reference(c)
    got = c["out"]
    assert got.shape == c["q"].shape and got.dtype == c["q"].dtype
    assert torch.isfinite(want).all(), "the reference read a poisoned slot: the case is wrong"
    assert torch.isfinite(got.float()).all(), "the kernel read a slot its row must not see"
    tol = _tolerance(dtype or c["q"].dtype)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name: str, interpreted: dict[str, dict[str, Any]]) -> None:
    c = interpreted[name]
    _check(c)
    ctx = c["packed"][:, tri.PACKED_CONTEXT]
    assert (c["out"][ctx == 0] == 0).all()  # a row that sees nothing reads nothing


@needs_triton
def test_custom_op_runs_the_kernel(interpreted: dict[str, dict[str, Any]]) -> None:
    _check(interpreted["op"])


@needs_triton
@pytest.mark.parametrize("name", ["engine-decode-fp32", "engine-decode-int8", "engine-eager"])
def test_engine_paths_take_the_kernel(name: str, interpreted: dict[str, dict[str, Any]]) -> None:
    """decode_attention (compiled with fullgraph around the op, after its in-graph KV write) and the eager path's
    decode rows, with the Triton path switched on, against the reference over the cache they wrote."""
    _check(interpreted[name])


def test_packed_layout_is_the_engines() -> None:
    from glowplug.engine.attention import CONTEXT, DECODE_COLS

    assert (tri.PACKED_CONTEXT, tri.PACKED_TABLE) == (CONTEXT, DECODE_COLS)


def test_partitions_depend_on_the_table_width_only() -> None:
    assert tri.partitions(10 * 4, 16, 16) == (16, 3)
    assert tri.partitions(512, 256, 64) == (256, 2)
    assert tri.partitions(256, 256, 64) == (256, 1)  # one partition: the single pass
    # Past MAX_PARTITIONS * partition tokens the partitions grow (whole tiles) instead of multiplying.
    length, count = tri.partitions(131072, 256, 64)
    assert count <= tri.MAX_PARTITIONS and length % 64 == 0 and length * count >= 131072
    with pytest.raises(ValueError):
        tri.partitions(64, 24, 16)


def test_the_op_traces_as_one_node() -> None:
    """make_fx over fake tensors: the fake kernel gives the shape and dtype, and the graph holds the op once."""
    from torch.fx.experimental.proxy_tensor import make_fx

    c = make_case("int8-bf16-window-split")
    op = tri.register_op()

    def step(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, packed: torch.Tensor
    ) -> torch.Tensor:
        return op(q, k, v, ks, vs, packed, c["scale"], c["window"]) + 1  # type: ignore[operator,no-any-return]

    gm = make_fx(step, tracing_mode="fake")(c["q"], c["k"], c["v"], c["k_scale"], c["v_scale"], c["packed"])
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "glowplug_triton" in str(n.target)]
    assert len(calls) == 1
    assert calls[0].args[-1] == 7  # the window goes in as a constant of the node
    fake = calls[0].meta["val"]
    assert fake.shape == c["q"].shape and fake.dtype == torch.bfloat16


def test_the_reason_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from glowplug.engine.attention import triton_attention_unavailable_reason

    assert "CUDA" in (triton_attention_unavailable_reason("cpu") or "")
    tri._reason.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(tri, "available", lambda: False)
            assert tri.unavailable_reason("cuda") == "triton is not installed"
        tri._reason.cache_clear()
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        if triton_pkg.available():
            assert "TRITON_INTERPRET" in (tri.unavailable_reason("cpu") or "")
    finally:
        tri._reason.cache_clear()  # the answers depended on the patches


@pytest.mark.parametrize("compile_mode", ["auto", "off"])
def test_native_kernels_stage_says_which_decode_attention_runs_on_cuda(compile_mode: str) -> None:
    """On a CUDA start the native_kernels stage (skipped: its kernels are CPU kernels) names the decode attention:
    the Triton kernel, or the torch ops and why (here, on a CPU-only torch: no CUDA device)."""
    from types import SimpleNamespace

    from glowplug.engine.stages.native_kernels import NativeKernels
    from glowplug.profiling.names import Attr

    config = SimpleNamespace(
        compile=compile_mode,
        compile_enabled=lambda: compile_mode != "off",
        compile_off_reason=lambda: f"--compile {compile_mode}",
    )
    # A dense model: on CUDA the stage then has no quantized layer to switch to the Triton linears, and says so.
    ctx = SimpleNamespace(
        config=config, device="cuda", model=torch.nn.Sequential(torch.nn.Linear(4, 4)), need=lambda value, *_: value
    )
    report = NativeKernels().run(ctx)  # type: ignore[arg-type]
    assert report.skipped_reason is not None
    said = report.attributes[Attr.DECODE_ATTENTION]
    if torch.cuda.is_available() and triton_pkg.available() and torch.cuda.get_device_capability() >= (8, 0):
        assert said == "triton"
    elif not torch.cuda.is_available():
        assert said == "torch ops: torch sees no CUDA device"
    assert report.skipped_reason.endswith(f"; decode attention: {said}")


# ------------------------------------------------------------------------------------------------------ CUDA
def _cuda_case(name: str) -> dict[str, Any]:
    c = make_case(name)
    return {key: val.cuda() if isinstance(val, torch.Tensor) else val for key, val in c.items()}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tiles", ["case", "default"])
def test_cuda_kernel_matches_reference(name: str, tiles: str) -> None:
    """On the GPU: bf16/fp16 tl.dot on tensor cores (p rounded to the cache dtype, so a looser bound), the
    case's small tiles and the launcher's defaults."""
    c = _cuda_case(name)
    kw = {"partition": c["partition"], "block_n": c["block_n"]} if tiles == "case" else {}
    c["out"] = tri.paged_decode_attention(
        c["q"],
        c["k"],
        c["v"],
        c["k_scale"],
        c["v_scale"],
        c["packed"][:, tri.PACKED_TABLE :],
        c["packed"][:, tri.PACKED_CONTEXT],
        c["scale"],
        c["window"],
        **kw,
    )
    dtype = c["q"].dtype
    want = _reference(c)
    assert torch.isfinite(c["out"].float()).all()
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(c["out"].float(), want, atol=tol, rtol=tol)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "dtype,int8,window", [(torch.bfloat16, False, None), (torch.bfloat16, True, None), (torch.float16, False, 300)]
)
def test_cuda_graph_replays_as_the_context_grows(dtype: torch.dtype, int8: bool, window: int | None) -> None:
    """A CUDA graph captured around the op at short contexts, replayed after the contexts grew (more blocks in
    the tables, more partitions live): each replay equals the reference, and equals an eager call."""
    from glowplug.engine.attention import decode_attention, triton_attention_unavailable_reason

    assert triton_attention_unavailable_reason("cuda") is None
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, d, bs, width = 4, 32, 8, 128, 16, 64  # up to 1024 tokens a row: 4 partitions of 256
    num_blocks = b * width + 1
    shape = (num_blocks, bs, kv_heads, d)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if int8:
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        caches = [t.cuda() for t in (kq, vq, ks, vs)]
    else:
        caches = [k.to(dtype).cuda(), v.to(dtype).cuda(), None, None]
    perm = torch.randperm(num_blocks - 1, generator=g).reshape(b, width)
    packed = torch.zeros(b, tri.PACKED_TABLE + width, dtype=torch.long, device="cuda")
    q = torch.randn(b, heads, d, generator=g).to(dtype).cuda()
    op = tri.register_op()

    def set_contexts(ctx: list[int]) -> None:
        packed.zero_()
        packed[:, tri.PACKED_CONTEXT] = torch.tensor(ctx)
        packed[:, tri.PACKED_TABLE :] = num_blocks - 1
        for i, c_len in enumerate(ctx):
            n = -(-c_len // bs)
            packed[i, tri.PACKED_TABLE : tri.PACKED_TABLE + n] = perm[i, :n].cuda()

    set_contexts([1, 5, 17, 40])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile the kernels before capture
            op(q, *caches, packed, d**-0.5, window)  # type: ignore[operator]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(q, *caches, packed, d**-0.5, window)  # type: ignore[operator]
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    for ctx in ([1, 5, 17, 40], [16, 300, 513, 1024], [1023, 1, 257, 770]):
        set_contexts(ctx)
        graph.replay()
        torch.cuda.synchronize()
        want = paged_decode_attention_reference(q, *caches, packed, d**-0.5, window)
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
        eager = op(q, *caches, packed, d**-0.5, window)  # type: ignore[operator]
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
    # decode_attention on CUDA tensors takes the op (the same numbers as a direct call).
    from glowplug.engine.kv_cache import LayerKV

    lk = LayerKV(*caches)
    knew = torch.randn(b, kv_heads, d, generator=g).to(dtype).cuda()
    packed[:, 2] = (num_blocks - 1) * bs  # write the new tokens into the scratch block, which no row sees
    got = decode_attention(q, knew, knew, lk, packed, d**-0.5, False, window)
    torch.testing.assert_close(got, op(q, *caches, packed, d**-0.5, window), atol=0, rtol=0)  # type: ignore[operator]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
