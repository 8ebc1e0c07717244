"""QuantLinear modules end to end: leading dims, dtypes, bias, meta construction + assign loading, moves."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from kernels_testutil import assert_matches, tol_for

from glowplug.kernels import formats as F
from glowplug.kernels import reference as R
from glowplug.kernels.dispatch import Dispatcher
from glowplug.kernels.modules import (
    DecodeKernel,
    Int2Linear,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    W8A8Linear,
    prepare_modules,
)

SPECS = ("int8", "int8-g32", "int4-g64", "int4s-g32", "int2-g128", "w8a8")
N, K = 72, 256


def _packed(spec: str) -> F.PackedWeight:
    return F.quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.05, spec)


def _tol(spec: str, x_dtype: torch.dtype) -> dict[str, float]:
    if spec == "w8a8" and x_dtype == torch.float32:
        return tol_for(spec)  # integer pipeline on the same fp32 activations as the oracle, fp32 output
    # Weight-only CPU kernels cast fp32 activations to bf16; bf16 callers get a bf16-rounded result.
    return {"max_rel": 3e-2, "fro_rel": 1.5e-2}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_reference_any_leading_dims(spec: str, x_dtype: torch.dtype) -> None:
    w = _packed(spec)
    bias = torch.randn(N) * 0.1
    mod = QuantLinear.from_packed(w, bias)
    gen = torch.Generator().manual_seed(1)
    for lead in [(1,), (3,), (2, 8), (4, 16), (1, 1, 64)]:  # M = 1, 3, 16, 64, 64 through every dispatch bucket
        x = torch.randn(*lead, K, generator=gen).to(x_dtype)
        y = mod(x)
        assert y.shape == (*lead, N) and y.dtype == x_dtype
        assert_matches(y, R.linear(x, w, bias), **_tol(spec, x_dtype), what=f"{spec} {lead} {x_dtype}")


@pytest.mark.parametrize("spec", SPECS)
def test_meta_construction_then_assign_load(spec: str) -> None:
    w = _packed(spec)
    by_spec: dict[str, tuple[type[QuantLinear], dict[str, Any]]] = {
        "int8": (Int8Linear, {"group_size": None}),
        "int8-g32": (Int8Linear, {"group_size": 32}),
        "int4-g64": (Int4Linear, {"group_size": 64}),
        "int4s-g32": (Int4Linear, {"group_size": 32, "symmetric": True}),
        "int2-g128": (Int2Linear, {"group_size": 128}),
        "w8a8": (W8A8Linear, {}),
    }
    cls, kwargs = by_spec[spec]
    mod = cls(K, N, bias=True, device="meta", **kwargs)
    assert mod.qweight.device.type == "meta"
    sd = {**w.tensors(), "bias": torch.full((N,), 0.5)}
    assert set(mod.state_dict()) == set(sd)
    mod.load_state_dict(sd, assign=True, strict=True)
    assert mod.qweight.device.type == "cpu" and mod._runtime is not None  # prepared by the post-load hook
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert_matches(mod(x), R.linear(x, w, sd["bias"]), **_tol(spec, x.dtype), what=spec)
    assert isinstance(mod.bias, torch.nn.Parameter) and not mod.bias.requires_grad


def test_empty_batch_and_bad_feature_count() -> None:
    mod = QuantLinear.from_packed(_packed("int4-g64"))
    y = mod(torch.randn(0, K))
    assert y.shape == (0, N)
    with pytest.raises(ValueError, match="input features"):
        mod(torch.randn(2, K + 1))


def test_device_move_and_deepcopy_rebuild_runtime() -> None:
    w = _packed("int4-g64")
    mod = QuantLinear.from_packed(w, dispatcher=Dispatcher())
    x = torch.randn(3, K).to(torch.bfloat16)
    y0 = mod(x)
    mod.to("cpu")
    assert mod._runtime is None  # invalidated by the move...
    assert torch.equal(mod(x), y0)  # ...and rebuilt lazily
    clone = copy.deepcopy(mod)
    assert clone.dispatcher is mod.dispatcher  # shared workspace, not duplicated
    assert torch.equal(clone(x), y0)
    model = torch.nn.Sequential(mod, torch.nn.ReLU(), QuantLinear.from_packed(_packed("int8")))
    assert prepare_modules(model) == 2


def test_layer_reports_its_kernel_and_prepared_runtime() -> None:
    """Readers (the dynamo stage, `bench decode`) go through these properties, not the layer's private state."""
    mod = QuantLinear.from_packed(_packed("int4-g64"), dispatcher=Dispatcher())
    assert mod.kernel is DecodeKernel.STOCK and mod.native is None  # no native kernel until enable_native
    mod.to("cpu")  # a move drops the prepared states; `runtime` prepares them again, as a forward would
    rt = mod.runtime
    assert rt is mod.runtime and mod.dispatcher.choose(rt, 1) in rt.states
    with pytest.raises(RuntimeError, match="meta device"):
        Int4Linear(K, N, device="meta").runtime  # noqa: B018 - the property raises


def test_sub_byte_layers_share_one_constructor() -> None:
    """int4 and int2 differ only in bits per code and in int4's symmetric variant; int2 has none to offer."""
    for cls, bits in ((Int4Linear, 4), (Int2Linear, 2)):
        mod = cls(K, N, group_size=64, device="meta")
        assert mod.qweight.shape == (N, K * bits // 8) and mod.scales.shape == mod.zeros.shape == (N, K // 64)
    assert Int4Linear(K, N, group_size=64, symmetric=True, device="meta").zeros is None
    with pytest.raises(ValueError, match="Int2Linear has no symmetric layout"):
        Int2Linear(K, N, symmetric=True, device="meta")


def test_dispatch_choice_depends_on_batch_size() -> None:
    mod = QuantLinear.from_packed(_packed("int8"), dispatcher=Dispatcher())
    rt = mod._runtime
    assert rt is not None
    disp = mod.dispatcher
    assert disp.choose(rt, 1) == "int8pack"  # bandwidth-bound packed kernel for decode
    assert disp.choose(rt, 256) == "dequant_bf16"  # compute-bound: dequant once, bf16 GEMM


def test_swapping_the_dispatch_table_re_prepares_layers() -> None:
    from glowplug.kernels.dispatch import DispatchTable

    disp = Dispatcher()
    w = _packed("int8")
    mod = QuantLinear.from_packed(w, dispatcher=disp)
    x = torch.randn(1, K).to(torch.bfloat16)
    mod(x)
    assert mod._runtime is not None and mod._runtime.choice[1] == "int8pack"
    # e.g. the engine installs a calibrated table after the model was loaded.
    disp.table = DispatchTable(rules={"cpu/int8_channel": [(None, "dequant_bf16")]})
    y = mod(x)
    rt = mod._runtime
    assert rt is not None and rt.choice[1] == "dequant_bf16" and "int8pack" not in rt.states
    assert_matches(y, R.linear(x, w), max_rel=3e-2, fro_rel=1e-2, what="after table swap")


@pytest.mark.parametrize("spec", SPECS)
def test_non_contiguous_inputs(spec: str) -> None:
    w = _packed(spec)
    mod = QuantLinear.from_packed(w)
    gen = torch.Generator().manual_seed(3)
    for m in (1, 5, 40):
        x = torch.randn(K, m, generator=gen).to(torch.bfloat16).t()  # [m, K] with strides (1, m)
        assert not x.is_contiguous() or m == 1
        assert_matches(mod(x), R.linear(x, w), **_tol(spec, x.dtype), what=f"{spec} M={m}")
        wide = torch.randn(m, 2 * K, generator=gen).to(torch.bfloat16)[:, ::2]  # stride-2 columns
        assert_matches(mod(wide), R.linear(wide, w), **_tol(spec, wide.dtype), what=f"{spec} strided M={m}")


@pytest.mark.parametrize("spec", ["int8", "int4-g64", "w8a8"])
def test_traces_as_one_graph_under_torch_compile(spec: str) -> None:
    # backend="eager" checks Dynamo tracing (no graph breaks, same numbers) without paying for Inductor codegen.
    torch._dynamo.reset()
    mod = QuantLinear.from_packed(_packed(spec), dispatcher=Dispatcher())
    compiled = torch.compile(mod, backend="eager", fullgraph=True, dynamic=False)
    for m in (1, 64):  # a packed-kernel bucket and a dequant/int_mm bucket
        x = torch.randn(m, K).to(torch.bfloat16)
        assert torch.equal(compiled(x), mod(x))  # type: ignore[no-untyped-call]


def test_padded_rows_bounds_the_gemm_shapes_and_the_waste() -> None:
    """Eager bf16 GEMMs are padded to a few row counts (kernels/modules.py: oneDNN keeps native memory per distinct
    M): never fewer rows, at most 15 more up to 128 rows and a quarter more past that, and few distinct sizes up to
    a 2048-token step."""
    from glowplug.kernels.modules import padded_rows

    assert padded_rows(1) == 1
    for m in range(2, 4097):
        p = padded_rows(m)
        assert m <= p and p - m <= max(15, m // 4), m
        assert padded_rows(p) == p  # a padded size is its own bucket
    assert len({padded_rows(m) for m in range(2, 2049)}) <= 24


@pytest.mark.parametrize("m", [3, 17, 129, 300])
def test_dense_bf16_eager_rows_match_stock_linear(m: int) -> None:
    """The padded eager path returns exactly M rows, each equal to stock F.linear's (the padding rows never leak)."""
    from glowplug.kernels.modules import DenseLinear

    torch.manual_seed(0)
    layer = DenseLinear(576, 960, bias=True).to(torch.bfloat16)
    x = torch.randn(m, 576, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (m, 960)
    ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
