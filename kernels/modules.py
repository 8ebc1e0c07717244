"""The linear layers of the model: dense (`DenseLinear`) and quantized (`QuantLinear` and its formats).

Eager calls go through stock torch: `F.linear` for dense weights, the dispatcher (kernels/dispatch.py) for packed
ones. Inside the compiled decode step (`torch.compiler.is_compiling()`, decided once at trace time) a layer whose
native decode kernel was enabled by `enable_native_decode` calls glowplug's native GEMV instead
(kernels/native.py), so the graph holds one opaque op per layer and no Python dispatch runs per step. On a GPU,
`enable_triton_decode` does the same for the quantized layers with the Triton GEMV/GEMM wrapped as custom ops
(kernels/triton/graph_ops.py): the dispatcher's launchers read the batch as a Python int and do not trace with a
symbolic one.

The quantized modules' buffers are exactly the canonical tensors of formats.py (`qweight`, `scales`, optional
`zeros`/`smooth`), so a quantized state dict loads with `load_state_dict(sd, assign=True, strict=True)` into modules
built on the `meta` device. Kernel-specific layouts are derived after loading (a load_state_dict post-hook, and
`enable_native_decode`) and again after a device move, and are never part of the state dict.
`native_kernels_in_eager` runs the switched quantized layers' native kernels outside a graph as well: the accuracy
report measures what the compiled step computes that way.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glowplug.base.machine import cpu_has_native_bf16

from .dispatch import Dispatcher, Runtime, default_dispatcher
from .formats import (
    Int2Weight,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    W8A8Weight,
)

if TYPE_CHECKING:
    from .native import NativeState
    from .triton.graph_ops import DecodeOp


class DecodeKernel(enum.Enum):
    """What a layer's compiled decode step runs (eager calls always take the stock path)."""

    STOCK = "stock"  # F.linear for a dense layer, the dispatcher's kernels (kernels/dispatch.py) for a quantized one
    NATIVE = "native"  # glowplug's native op (kernels/native.py), switched on by `enable_native_decode`
    TRITON = "triton"  # the Triton GEMV/GEMM as custom ops (kernels/triton/graph_ops.py): `enable_triton_decode`


@dataclass(frozen=True)
class NativeSwitch:
    """What one layer's `enable_native` (or a QuantLinear's `enable_triton`) did: the kind of layer (how
    `enable_native_decode` counts it), whether a native (or Triton) kernel now serves its compiled decode, and the
    bytes a batch-1 decode step reads through it (0 if none)."""

    kind: Literal["dense", "quantized", "attention"]
    switched: bool
    nbytes: int = 0
    # Why a layer the native op would otherwise serve stays on the stock path (empty when it switched, or when no
    # native op applies at all): `enable_native_decode` gathers these so the stage can say so on its span.
    fallback: str = ""


@runtime_checkable
class NativeDecodeLayer(Protocol):
    """A layer whose compiled decode step can run a native op. The linear layers here implement it, and so do the
    model's own layers that need one (its attention, a tied head): each knows its own attributes, so
    `enable_native_decode` walks any model without knowing how the model is laid out."""

    def enable_native(self, small_m: int, activation_dtype: torch.dtype) -> NativeSwitch:
        """Switch this layer's compiled decode to a native kernel where one serves it (`small_m`: the largest batch
        the row-major dense kernel takes; `activation_dtype`: the model's dtype)."""
        ...


# Rows from which a bf16 projection without hardware bf16 runs in fp32 arithmetic (a prompt, not a decode batch).
FP32_PROMPT_ROWS = 16


def padded_rows(m: int) -> int:
    """The row count an eager bf16/fp16 GEMM of `m` rows is padded to: multiples of 16 up to 128, then four sizes per
    doubling (a quarter of the lower power of two), so at most 25% extra rows, and ~12% on average.

    Why: oneDNN, behind `F.linear` in bf16, builds and caches a primitive per distinct M, and its native heap grows
    with each one (about 0.9 MiB per new M over SmolLM2's five shapes) for as long as new prompt lengths keep
    arriving: the server's RSS crept over a soak (reports/serve/soak.md). Padded this way the eager prefill meets at
    most 24 sizes up to 2048 rows. Small M costs the same padded or not (the weights' read dominates), and fewer
    primitive builds made a mixed-length stream faster, not slower, in the measurement behind this (a standalone
    loop over 600 lengths: +230 MiB unpadded vs +2 MiB padded to 32, 6.6 s vs 4.9 s). fp32 is left alone: its
    GEMM does not go through oneDNN's primitive cache, and the fp32 parity tests stay bit-for-bit on stock calls.
    """
    if m <= 1:
        return m
    if m <= 128:
        return -(-m // 16) * 16
    step = 1 << ((m - 1).bit_length() - 3)
    return -(-m // step) * step


class DenseLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose compiled decode step can run a native GEMV."""

    native_small_m: int | None = None  # set by enable_native: None means stock F.linear everywhere
    # enable_native may also register `native_blocked`: the bf16 weight in kernels.native.pack_blocked's layout

    def forward(self, x: Tensor) -> Tensor:
        blocked = self.native_blocked if "native_blocked" in self._buffers else None
        return self.project(x, self.weight, self.bias, self.native_small_m, blocked)  # type: ignore[arg-type]

    @staticmethod
    def project(
        x: Tensor, weight: Tensor, bias: Tensor | None, small_m: int | None, blocked: Tensor | None = None
    ) -> Tensor:
        """x @ weight^T (+ bias): inside a compiled decode step the blocked native op (`blocked`, the weight in
        kernels.native.pack_blocked's layout) or the row-major one when enabled, else F.linear."""
        if blocked is not None and torch.compiler.is_compiling() and x.dim() == 2:
            yb: Tensor = torch.ops.glowplug_native.dense_blocked(x, blocked, weight.shape[0])
            return yb if bias is None else yb + bias
        if small_m is not None and torch.compiler.is_compiling() and x.dim() == 2:
            y: Tensor = torch.ops.glowplug_native.dense_linear(x, weight, small_m)
            return y if bias is None else y + bias
        # Both eager workarounds below are the CPU's (oneDNN's): a GPU's prompt takes F.linear as it is. And
        # `is_compiling` is asked first: inside a compiled step the batch is symbolic, and comparing it with a number
        # is a data-dependent guard that breaks the graph (inside the layers' nested compile region, an error:
        # seen on an H100, where the bf16 decode step's dense projections reach this code).
        if torch.compiler.is_compiling() or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.shape[0] >= FP32_PROMPT_ROWS and not cpu_has_native_bf16():
            # A prompt's bf16 projection on a CPU without hardware bf16 (the avx2 and avx512 levels, where --dtype
            # auto picks bf16 for the decode's sake): oneDNN's emulated bf16 GEMM there made prompts several times
            # slower than in float32 (the prefill column of reports/decode-isa.md has both dtypes); widening the
            # weight costs one pass over it per call, little beside a prompt's arithmetic.
            y32 = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            return y32.to(torch.bfloat16)
        if x.dim() == 2 and x.dtype != torch.float32:
            m = x.shape[0]
            rows = padded_rows(m)
            if rows != m:
                return F.linear(F.pad(x, (0, 0, 0, rows - m)), weight, bias)[:m]
        return F.linear(x, weight, bias)

    def enable_native(self, small_m: int, activation_dtype: torch.dtype) -> NativeSwitch:
        """Switch this layer's compiled decode to a native kernel (see `enable_dense_native`); the weight's own
        dtype decides which one, so `activation_dtype` is not needed here."""
        nbytes = enable_dense_native(self, self.weight, small_m)
        return NativeSwitch("dense", nbytes > 0, nbytes)


def enable_dense_native(module: nn.Module, weight: Tensor, small_m: int) -> int:
    """bf16: the blocked kernel (every ISA level has one), on a packed copy registered as `module.native_blocked`
    (batches stay near the batch-1 cost); fp32: the row-major kernel on the weight itself (`module.native_small_m`).
    Returns the bytes a decode step reads through it, 0 if no native kernel serves this dtype."""
    from .native import pack_blocked

    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
        packed, _ = pack_blocked(weight)
        module.register_buffer("native_blocked", packed, persistent=False)
        return packed.numel() * packed.element_size()
    if weight.dtype in (torch.bfloat16, torch.float32):
        module.native_small_m = small_m  # type: ignore[assignment]
        return weight.numel() * weight.element_size()
    return 0


class QuantLinear(nn.Module):
    """Base class: bias handling, shape plumbing, runtime preparation. Subclasses declare buffers and `packed()`.

    Inference only: forward does not support autograd through the quantized weight."""

    # Buffers registered by subclasses (declared here for type checkers; nn.Module stores them in _buffers).
    qweight: Tensor
    scales: Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        if bias:
            # A frozen Parameter, like nn.Linear's, so code that walks parameters() still sees it.
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._dispatcher = dispatcher
        self._runtime: Runtime | None = None
        self._native: NativeState | None = None  # once enable_native found a kernel; its tensors are buffers
        # Once enable_triton switched the layer: the op call, and the buffers (by name) it takes as its tensors.
        self._triton: DecodeOp | None = None
        self._triton_buffers: tuple[str | None, ...] = ()
        # The M a compiled graph with a symbolic batch plans its (non-native) kernel for; set by whoever traces such a
        # graph (engine/stages/dynamo_transform.py). None: a traced graph has static shapes and plans for its own M.
        self.trace_m: int | None = None
        self.register_load_state_dict_post_hook(_after_load)  # type: ignore[no-untyped-call]
        self._register_weights(device)

    # -- subclass interface -------------------------------------------------------------------------------
    def _register_weights(self, device: torch.device | str | None) -> None:
        """Register the format's buffers when the layer's shape alone sets them (W8A8); a format whose buffers also
        take a group size registers them in its own __init__, after this one."""

    def packed(self) -> PackedWeight:
        raise NotImplementedError

    # -- runtime ------------------------------------------------------------------------------------------
    @property
    def kernel(self) -> DecodeKernel:
        """What this layer's compiled decode step runs: the native op once `enable_native` found one for it, the
        Triton op once `enable_triton` switched it, else the dispatcher's kernels (which do not trace with a
        symbolic batch: engine/stages/dynamo_transform.py then keeps the step eager)."""
        if self._native is not None:
            return DecodeKernel.NATIVE
        return DecodeKernel.STOCK if self._triton is None else DecodeKernel.TRITON

    @property
    def native(self) -> NativeState | None:
        """The native kernel's state (its layout and the bytes a decode step reads), None while `kernel` is STOCK."""
        return self._native

    @property
    def prepared_runtime(self) -> Runtime | None:
        """The prepared kernel states if a forward or `runtime` made them; never prepares (a memory count must not
        allocate what a compiled step never used)."""
        return self._runtime

    @property
    def runtime(self) -> Runtime:
        """The dispatcher's prepared kernel states for this layer's current device, prepared now if they were not
        (as the first eager forward would)."""
        if self._runtime is None:
            self.prepare()
        if self._runtime is None:
            raise RuntimeError(f"{type(self).__name__} is still on the meta device: load its weights first")
        return self._runtime

    @property
    def dispatcher(self) -> Dispatcher:
        if self._dispatcher is None:
            # Resolved once and kept, so forward (and torch.compile tracing it) reads a plain attribute.
            self._dispatcher = default_dispatcher()
        return self._dispatcher

    def prepare(self) -> None:
        """Build the kernel states for the current device now (otherwise done on first forward)."""
        self._runtime = None
        if all(b.device.type != "meta" for b in self.buffers(recurse=False)):
            self._runtime = self.dispatcher.prepare(self.packed())

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> QuantLinear:
        # Device/dtype moves invalidate the derived layouts; rebuild lazily on the next forward (the native layout
        # is CPU-only, the Triton one for the device it was made on: both are dropped, and enable_native_decode or
        # enable_triton_decode must run again).
        self._runtime = None
        self._native = None
        self._drop_triton()
        out: QuantLinear = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        return out

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: expected {self.in_features} input features, got {x.shape[-1]}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        compiling = torch.compiler.is_compiling()
        if self._native is not None and (compiling or _NATIVE_EAGER.get()):
            from .native import native_linear

            y = native_linear(x2, self._native, self.native_tensors())
            return self._finish(y, x, lead)
        if self._triton is not None and (compiling or _NATIVE_EAGER.get()):
            from .triton.graph_ops import linear as triton_linear

            y = triton_linear(x2, self._triton, self.triton_tensors())
            return self._finish(y, x, lead)
        if not compiling and x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        disp = self.dispatcher
        rt = self._runtime
        if rt is None or rt.table_version != disp.table_version or rt.device != x2.device:
            self.prepare()
            rt = self._runtime
            assert rt is not None
        if compiling:
            # A traced batch size is symbolic (the decode graph's is unbacked): plan for trace_m then; a static one
            # is a plain int and picks its own kernel.
            y = disp.run_path(disp.choose(rt, self.trace_m if self.trace_m is not None else int(x2.shape[0])), x2, rt)
        else:
            y = disp.linear(x2, rt)
        return self._finish(y, x, lead)

    def native_tensors(self) -> tuple[Tensor, ...]:
        assert self._native is not None
        return tuple(getattr(self, f"native_{i}") for i in range(len(self._native.tensors)))

    def enable_native(self, small_m: int, activation_dtype: torch.dtype) -> NativeSwitch:
        """Derive this layer's native-kernel layout (kernels/native.py) for activations of `activation_dtype` and
        register it as non-persistent buffers, so a compiled graph takes them as inputs. Not switched when no native
        kernel serves this combination (the dispatcher's kernels stay). The packed kernels serve every batch size,
        so `small_m` (the dense row-major kernel's limit) does not apply."""
        from .native import prepare_native

        st = prepare_native(self.packed(), activation_dtype)
        if st is None:
            return NativeSwitch("quantized", False)
        for i, t in enumerate(st.tensors):
            self.register_buffer(f"native_{i}", t, persistent=False)
        self._native = st
        return NativeSwitch("quantized", st.nbytes > 0, st.nbytes)

    def triton_tensors(self) -> tuple[Tensor | None, ...]:
        """The Triton op's tensor arguments, read from this module's buffers (None for an absent optional one)."""
        return tuple(None if name is None else getattr(self, name) for name in self._triton_buffers)

    def enable_triton(self) -> NativeSwitch:
        """Switch this layer's compiled decode step to the Triton op (kernels/triton/graph_ops.py) where the kernels
        run on this layer's device (`kernels.triton.ops.supports`); otherwise the dispatcher's kernels stay and the
        switch says why. Tensors the op needs in another form than a buffer already holds (W8A8's 1/smooth, a scale
        of another dtype) are registered as non-persistent `triton_*` buffers; the rest are the layer's own buffers,
        so the weight is never held twice."""
        from .triton import ops as triton_ops
        from .triton.graph_ops import decode_op, register

        self._drop_triton()
        w = self.packed()
        why = triton_ops.unsupported_reason(w.qweight.device)
        if why is not None:
            return NativeSwitch("quantized", False, fallback=why)
        register()
        op, tensors = decode_op(triton_ops.prepare(w))
        fields = ("qweight", "scales", "inv_smooth" if op.w8a8 else "zeros")
        self._triton_buffers = tuple(None if t is None else self._buffer_for(f, t) for f, t in zip(fields, tensors))
        self._triton = op
        return NativeSwitch("quantized", True, op.nbytes)

    def _buffer_for(self, field: str, t: Tensor) -> str:
        """The name of a buffer holding exactly `t` (same memory, shape, strides and dtype), registering `t` as
        `triton_<field>` when none does."""
        for name, b in self._buffers.items():
            if (
                b is not None
                and b.dtype == t.dtype
                and b.shape == t.shape
                and b.stride() == t.stride()
                and b.data_ptr() == t.data_ptr()
            ):
                return name
        name = f"triton_{field}"
        self.register_buffer(name, t, persistent=False)
        return name

    def _drop_triton(self) -> None:
        self._triton = None
        self._triton_buffers = ()
        for name in [n for n in self._buffers if n.startswith("triton_")]:
            del self._buffers[name]

    def _finish(self, y: Tensor, x: Tensor, lead: torch.Size) -> Tensor:
        if y.dtype != x.dtype:  # skip no-op casts: this runs ~200 times per decoded token
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + (self.bias if self.bias.dtype == x.dtype else self.bias.to(x.dtype))
        return y.view(*lead, self.out_features) if y.is_contiguous() else y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    @classmethod
    def from_packed(
        cls, w: PackedWeight, bias: Tensor | None = None, *, dispatcher: Dispatcher | None = None
    ) -> QuantLinear:
        """Build the module for an already-quantized weight (tests, benchmarks, ad-hoc use)."""
        n, k = w.shape
        common: dict[str, Any] = {
            "bias": bias is not None,
            "device": w.qweight.device,
            "dispatcher": dispatcher,
            "bias_dtype": bias.dtype if bias is not None else torch.float32,
        }
        mod: QuantLinear
        if isinstance(w, Int8Weight):
            mod = Int8Linear(k, n, group_size=w.group_size, **common)
        elif isinstance(w, Int4Weight):
            mod = Int4Linear(k, n, group_size=w.group_size, symmetric=w.symmetric, **common)
        elif isinstance(w, Int2Weight):
            mod = Int2Linear(k, n, group_size=w.group_size, **common)
        elif isinstance(w, W8A8Weight):
            mod = W8A8Linear(k, n, **common)
        else:
            raise TypeError(f"unknown packed weight {type(w).__name__}")
        state = dict(w.tensors())
        if bias is not None:
            state["bias"] = bias
        mod.load_state_dict(state, assign=True, strict=True)
        return mod


def _after_load(module: nn.Module, incompatible: Any) -> None:
    # `incompatible` covers the whole load, not this module, so judge readiness by this module's own buffers.
    assert isinstance(module, QuantLinear)
    if all(b.device.type != "meta" for b in module.buffers(recurse=False)):
        module.prepare()


# Set only by `native_kernels_in_eager`; read in eager forwards only (inside a trace `compiling` decides first).
_NATIVE_EAGER: ContextVar[bool] = ContextVar("glowplug_native_eager", default=False)


@contextmanager
def native_kernels_in_eager() -> Iterator[None]:
    """Within this block, the quantized layers that `enable_native_decode` (or `enable_triton_decode`) switched run
    their decode kernel in eager calls too, at any batch (the accuracy report scores those kernels' own arithmetic,
    such as int4's int8 activations, on prefill windows; the Triton op's tests compare a traced layer with it)."""
    token = _NATIVE_EAGER.set(True)
    try:
        yield
    finally:
        _NATIVE_EAGER.reset(token)


def enable_native_decode(
    model: nn.Module, small_m: int, activation_dtype: torch.dtype, fallbacks: dict[str, int] | None = None
) -> dict[str, int]:
    """Switch every layer of `model` that can run a native op in its compiled decode step (a `NativeDecodeLayer`:
    the linear layers, the model's attention) to it where one serves it (call after loading, once
    `kernels.native.load_native` succeeded). Returns how many layers of each kind switched and the bytes one
    batch-1 decode step reads through the linear ones. `fallbacks`, when given, receives each distinct reason a
    layer gave for staying on the stock path (`NativeSwitch.fallback`) with how many layers gave it."""
    counts = {"dense": 0, "quantized": 0, "attention": 0}
    nbytes = 0
    for mod in model.modules():
        if isinstance(mod, NativeDecodeLayer):
            switch = mod.enable_native(small_m, activation_dtype)
            counts[switch.kind] += switch.switched
            nbytes += switch.nbytes
            if switch.fallback and fallbacks is not None:
                fallbacks[switch.fallback] = fallbacks.get(switch.fallback, 0) + 1
    return {**counts, "bytes_per_token": nbytes}


def enable_triton_decode(model: nn.Module, fallbacks: dict[str, int] | None = None) -> dict[str, int]:
    """The GPU counterpart of `enable_native_decode`: switch every quantized layer of `model` (call after loading and
    after the move to its device) to the Triton op in its compiled decode step where the kernels run there. Dense
    layers need nothing: their F.linear traces as it is. Returns how many quantized layers there are, how many
    switched, and the bytes one batch-1 decode step reads through them; `fallbacks`, when given, receives each
    reason a layer stayed on the dispatcher (no triton, a GPU older than Ampere) with how many layers gave it."""
    counts = {"quantized": 0, "switched": 0, "bytes_per_token": 0}
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            switch = mod.enable_triton()
            counts["quantized"] += 1
            counts["switched"] += switch.switched
            counts["bytes_per_token"] += switch.nbytes
            if switch.fallback and fallbacks is not None:
                fallbacks[switch.fallback] = fallbacks.get(switch.fallback, 0) + 1
    return counts


def prepare_modules(model: nn.Module) -> int:
    """Prepare every QuantLinear in `model` for its current device (call after `.to(device)`, before compiling,
    so no kernel layout is built inside a traced forward). Returns how many were prepared."""
    count = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.prepare()
            count += 1
    return count


def _groups(k: int, group_size: int | None) -> int:
    if group_size is not None and k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    return 1 if group_size is None else k // group_size


class Int8Linear(QuantLinear):
    """int8 weight-only; per-channel (group_size=None) or group-wise."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        group_size: int | None = None,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, bias_dtype=bias_dtype, dispatcher=dispatcher)
        self.group_size = group_size
        g = _groups(in_features, group_size)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, g, dtype=torch.float32, device=device))

    def packed(self) -> Int8Weight:
        return Int8Weight(self.qweight, self.scales, self.group_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class SubByteLinear(QuantLinear):
    """Weight-only, group-wise, `bits`-bit codes packed 8 // bits to a byte (formats.pack_bits): the buffers and
    constructor Int4Linear and Int2Linear share; `zeros` only when asymmetric. Subclasses set `bits`, whether their
    format has a symmetric variant, and `packed()`."""

    bits: int
    has_symmetric: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        group_size: int = 128,
        symmetric: bool = False,
        device: torch.device | str | None = None,
        bias_dtype: torch.dtype = torch.float32,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        if symmetric and not self.has_symmetric:
            raise ValueError(f"{type(self).__name__} has no symmetric layout (its format always has zeros)")
        super().__init__(in_features, out_features, bias, device=device, bias_dtype=bias_dtype, dispatcher=dispatcher)
        self.group_size = group_size
        self.symmetric = symmetric
        g = _groups(in_features, group_size)
        self.register_buffer(
            "qweight", torch.zeros(out_features, in_features * self.bits // 8, dtype=torch.uint8, device=device)
        )
        self.register_buffer("scales", torch.ones(out_features, g, dtype=torch.float32, device=device))
        if symmetric:
            self.zeros: Tensor | None = None
        else:
            self.register_buffer("zeros", torch.zeros(out_features, g, dtype=torch.float32, device=device))

    def extra_repr(self) -> str:
        symmetric = f", symmetric={self.symmetric}" if self.has_symmetric else ""
        return f"{super().extra_repr()}, group_size={self.group_size}{symmetric}"


class Int4Linear(SubByteLinear):
    """int4 weight-only, group-wise; `zeros` buffer only when asymmetric."""

    bits = 4
    has_symmetric = True

    def packed(self) -> Int4Weight:
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size)


class Int2Linear(SubByteLinear):
    """int2 weight-only, group-wise asymmetric."""

    bits = 2

    def packed(self) -> Int2Weight:
        assert self.zeros is not None  # int2 is always asymmetric: the constructor registers zeros
        return Int2Weight(self.qweight, self.scales, self.zeros, self.group_size)


class W8A8Linear(QuantLinear):
    """int8 per-channel weights x per-token dynamic int8 activations; `smooth` is all ones without SmoothQuant."""

    smooth: Tensor

    def _register_weights(self, device: torch.device | str | None) -> None:
        n, k = self.out_features, self.in_features
        self.register_buffer("qweight", torch.zeros(n, k, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("smooth", torch.ones(k, dtype=torch.float32, device=device))

    def packed(self) -> W8A8Weight:
        return W8A8Weight(self.qweight, self.scales, self.smooth)
