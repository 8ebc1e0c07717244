"""Which kernel each layer of a loaded model runs, and the weight bytes one decode step reads through it.

A decode step streams every weight it touches once, so its speed follows these bytes over the memory bandwidth;
the benchmarks set them against a streaming-read probe. The walk reads the layers as they are after start-up: a
layer switched to a native op reads its native layout, a GGUF layer its stored blocks, an eager quantized layer the
layout its dispatcher picks at that batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# What a layer runs (LayerKernel.kernel) besides the dispatcher's path names.
GGUF_STORED = "gguf stored blocks"
NATIVE = "native"
DENSE = "dense"
HEAD = "tied head"
NORM = "norm"


@dataclass(frozen=True)
class LayerKernel:
    """One layer that reads weights in a decode step: its module name, the kernel it runs there (one of the names
    above, or the quantized dispatcher's path name, e.g. `int4_mm`), and the weight bytes that step reads."""

    name: str
    kernel: str
    weight_bytes: int


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in `obj` (a tensor, a dataclass of them, or a tuple or list of those)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


def layer_kernels(model: torch.nn.Module, compiled: bool, batch: int = 1) -> list[LayerKernel]:
    """Every weight-reading layer of `model` in module order, with the kernel a decode step of `batch` rows runs
    in it. `compiled`: the step is the compiled one (a quantized layer switched to a native op runs it there; an
    eager step runs its dispatcher's choice). The embedding is left out: a lookup reads a few rows only."""
    from glowplug.kernels.gguf import GGUFLinear
    from glowplug.kernels.modules import DenseLinear, QuantLinear
    from glowplug.kernels.native import native_weight_bytes

    from .models.llama import RMSNorm, TiedHead

    out: list[LayerKernel] = []
    for name, mod in model.named_modules():
        bias = tensor_bytes(getattr(mod, "bias", None))
        if isinstance(mod, GGUFLinear):
            out.append(LayerKernel(name, GGUF_STORED, mod.nbytes + bias))
        elif isinstance(mod, QuantLinear):
            if compiled and mod.native is not None:
                out.append(LayerKernel(name, NATIVE, native_weight_bytes(mod.native) + bias))
            else:
                rt = mod.runtime
                path = mod.dispatcher.choose(rt, batch)
                out.append(LayerKernel(name, path, tensor_bytes(rt.states[path]) + bias))
        elif isinstance(mod, DenseLinear):
            out.append(LayerKernel(name, DENSE, tensor_bytes(mod.weight) + bias))
        elif isinstance(mod, TiedHead):
            out.append(LayerKernel(name, HEAD, tensor_bytes(mod.weight)))
        elif isinstance(mod, RMSNorm):
            out.append(LayerKernel(name, NORM, tensor_bytes(mod.weight)))
    return out


@dataclass(frozen=True)
class WeightTraffic:
    """The weight bytes one batch-1 decode step reads, and where the figure comes from: the native_kernels stage's
    own count (every layer it switched to a native op, the LM head included) when the start made one, else the sum
    of `layer_kernels`."""

    bytes_per_step: int
    from_start: bool  # True: the native_kernels span's count; False: the layer walk
