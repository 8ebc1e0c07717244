"""Quantization schemes by config name: quantize a state dict offline, then swap modules for runtime.

Follows gpt-fast's split: `quantize_state_dict` turns `<layer>.weight` into the format's canonical tensors
(`<layer>.qweight`, `<layer>.scales`, ...) and `convert_for_runtime` replaces the same layers' nn.Linear modules
with QuantLinears whose buffers have exactly those names, so that
    model = convert_for_runtime(model_on_meta); model.load_state_dict(qsd, assign=True, strict=True)
works. Only the attention/MLP projections are quantized; embeddings, norms, biases and lm_head stay as they are.

`skip` callbacks receive the *module* name (the state-dict key without ".weight"), in both functions, so the
same callback selects the same layers on both sides. `quantize_head=True` adds the output projection (`lm_head`):
it is a quarter of SmolLM2's bytes per decoded token.

The group size is per layer: the configured one where it divides K, else the largest smaller allowed one that
does (formats.effective_group_size); SmolLM2's K=576 projections get 64 under a configured 128.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from .dispatch import Dispatcher
from .formats import (
    GROUP_SIZES,
    PackedWeight,
    effective_group_size,
    quantize_int2,
    quantize_int4,
    quantize_int8,
    quantize_w8a8,
    smoothquant_factors,
)
from .modules import Int2Linear, Int4Linear, Int8Linear, QuantLinear, W8A8Linear

# The decoder's projections: glowplug's fused names and the Hugging Face ones (state dicts straight from a checkpoint).
LINEAR_NAMES: tuple[str, ...] = (
    "qkv_proj",
    "o_proj",
    "gate_up_proj",
    "down_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
)
HEAD_NAME = "lm_head"
SkipFn = Callable[[str], bool]


def is_target_module(name: str, *, quantize_head: bool = False) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in LINEAR_NAMES or (quantize_head and name == HEAD_NAME)


def _never(_: str) -> bool:
    return False


def tensor_bytes(sd: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


class QuantScheme:
    """A weight format plus the glue for state dicts and module trees. Subclasses set name/bits and the hooks."""

    name: str = ""
    bits: int = 16
    default_group_size: int | None = None
    group_sizes: tuple[int, ...] = ()
    needs_group: bool = False

    # -- per-format hooks ----------------------------------------------------------------------------------
    def quantize_weight(self, weight: Tensor, group_size: int | None, name: str) -> PackedWeight:
        raise NotImplementedError

    def make_module(self, linear: nn.Linear, group_size: int | None, dispatcher: Dispatcher | None) -> QuantLinear:
        raise NotImplementedError

    def _converts(self, name: str, *, quantize_head: bool, skip: SkipFn) -> bool:
        """Whether the projection `name` takes this format (a target, not skipped); NoQuant converts none."""
        return is_target_module(name, quantize_head=quantize_head) and not skip(name)

    # -- public API ----------------------------------------------------------------------------------------
    def resolve_group_size(self, group_size: int | None) -> int | None:
        if group_size is None:
            return self.default_group_size
        if group_size not in self.group_sizes:
            valid = ", ".join(map(str, self.group_sizes)) or "none (leave it unset)"
            raise ValueError(f"group_size {group_size} is not supported by {self.name!r}; valid: {valid}")
        return group_size

    def layer_group_size(self, k: int, group_size: int | None) -> int | None:
        """The group size one layer with K inputs uses under the (resolved) configured group size."""
        if group_size is None:
            return None
        return effective_group_size(k, group_size, GROUP_SIZES)

    def quantize_state_dict(
        self,
        sd: Mapping[str, Tensor],
        *,
        group_size: int | None = None,
        skip: SkipFn | None = None,
        quantize_head: bool = False,
    ) -> dict[str, Tensor]:
        """Quantize the 2-D `.weight` of every target projection not skipped; pass all else through unchanged."""
        gs = self.resolve_group_size(group_size)
        skip = skip or _never
        out: dict[str, Tensor] = {}
        for key, tensor in sd.items():
            module = key[: -len(".weight")] if key.endswith(".weight") else None
            if module is None or tensor.ndim != 2 or not self._converts(module, quantize_head=quantize_head, skip=skip):
                out[key] = tensor
                continue
            packed = self.quantize_weight(tensor, self.layer_group_size(int(tensor.shape[1]), gs), module)
            for suffix, t in packed.tensors().items():
                out[f"{module}.{suffix}"] = t
        return out

    def convert_for_runtime(
        self,
        model: nn.Module,
        *,
        group_size: int | None = None,
        skip: SkipFn | None = None,
        dispatcher: Dispatcher | None = None,
        quantize_head: bool = False,
    ) -> nn.Module:
        """Swap target nn.Linear modules in place for this scheme's QuantLinear (on the Linear's device, with
        its bias dtype). Returns `model` for chaining."""
        gs = self.resolve_group_size(group_size)
        skip = skip or _never
        targets = [
            (name, mod)
            for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and self._converts(name, quantize_head=quantize_head, skip=skip)
        ]
        for name, linear in targets:
            layer_gs = self.layer_group_size(linear.in_features, gs)
            model.set_submodule(name, self.make_module(linear, layer_gs, dispatcher))
        return model

    def bits_per_weight(self, group_size: int | None = None, *, in_features: int | None = None) -> float:
        """Nominal storage bits per weight including fp32 scales/zeros (per-channel scales count 32/K bits when
        in_features is given, else 0)."""
        gs = self.resolve_group_size(group_size)
        per_group = 32 * (2 if self._has_zeros() else 1)
        if gs is not None:
            return self.bits + per_group / gs
        return self.bits + (per_group / in_features if in_features else 0.0)

    def weight_bytes(self, sd: Mapping[str, Tensor], *, only_linear: bool = False) -> int:
        """Bytes of the state dict; with only_linear, just the target projections' tensors (weights, scales,
        zeros, smooth; biases excluded) - the traffic a decode step streams through the quantized kernels."""
        if not only_linear:
            return tensor_bytes(sd)
        total = 0
        for key, t in sd.items():
            module, _, leaf = key.rpartition(".")
            # the head counts once it is quantized (its tensors are then qweight/scales/...; a plain `weight` is not)
            if is_target_module(module, quantize_head=leaf != "weight") and leaf != "bias":
                total += t.numel() * t.element_size()
        return total

    def _has_zeros(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class NoQuant(QuantScheme):
    """The model as it is: every state dict passes through and no module is swapped (the base methods, with
    `_converts` false); a group size is refused."""

    name = "none"
    bits = 16

    def resolve_group_size(self, group_size: int | None) -> int | None:
        if group_size is not None:
            raise ValueError("group_size does not apply to quantization 'none'")
        return None

    def _converts(self, name: str, *, quantize_head: bool, skip: SkipFn) -> bool:
        return False


def _module_kwargs(linear: nn.Linear, dispatcher: Dispatcher | None) -> dict[str, Any]:
    bias = linear.bias
    return {
        "bias": bias is not None,
        "device": linear.weight.device,
        "dispatcher": dispatcher,
        "bias_dtype": bias.dtype if bias is not None else torch.float32,
    }


class Int8Scheme(QuantScheme):
    name = "int8"
    bits = 8
    default_group_size = None  # per-channel: the only int8 layout with a dedicated aten kernel
    group_sizes = GROUP_SIZES

    def quantize_weight(self, weight: Tensor, group_size: int | None, name: str) -> PackedWeight:
        return quantize_int8(weight, group_size)

    def make_module(self, linear: nn.Linear, group_size: int | None, dispatcher: Dispatcher | None) -> QuantLinear:
        return Int8Linear(
            linear.in_features, linear.out_features, group_size=group_size, **_module_kwargs(linear, dispatcher)
        )


class Int4Scheme(QuantScheme):
    name = "int4"
    bits = 4
    default_group_size = 128
    group_sizes = GROUP_SIZES

    def __init__(self, symmetric: bool = False) -> None:
        self.symmetric = symmetric

    def quantize_weight(self, weight: Tensor, group_size: int | None, name: str) -> PackedWeight:
        return quantize_int4(weight, group_size or 128, symmetric=self.symmetric)

    def make_module(self, linear: nn.Linear, group_size: int | None, dispatcher: Dispatcher | None) -> QuantLinear:
        return Int4Linear(
            linear.in_features,
            linear.out_features,
            group_size=group_size or 128,
            symmetric=self.symmetric,
            **_module_kwargs(linear, dispatcher),
        )

    def _has_zeros(self) -> bool:
        return not self.symmetric


class Int2Scheme(QuantScheme):
    name = "int2"
    bits = 2
    default_group_size = 128
    group_sizes = (128,)  # what the config offers; layers whose K it does not divide fall back to 64/32

    def quantize_weight(self, weight: Tensor, group_size: int | None, name: str) -> PackedWeight:
        return quantize_int2(weight, group_size or 128)

    def make_module(self, linear: nn.Linear, group_size: int | None, dispatcher: Dispatcher | None) -> QuantLinear:
        return Int2Linear(
            linear.in_features, linear.out_features, group_size=group_size or 128, **_module_kwargs(linear, dispatcher)
        )

    def _has_zeros(self) -> bool:
        return True


class W8A8Scheme(QuantScheme):
    """int8 weights x dynamic int8 activations. Pass `act_absmax` (module name -> per-input-channel max |x|
    from calibration) to fold SmoothQuant factors in; without it the smoothing factors are all ones."""

    name = "w8a8"
    bits = 8

    def __init__(self, act_absmax: Mapping[str, Tensor] | None = None, alpha: float = 0.5) -> None:
        self.act_absmax = dict(act_absmax or {})
        self.alpha = alpha

    def quantize_weight(self, weight: Tensor, group_size: int | None, name: str) -> PackedWeight:
        stats = self.act_absmax.get(name)
        smooth = smoothquant_factors(stats, weight, self.alpha) if stats is not None else None
        return quantize_w8a8(weight, smooth)

    def make_module(self, linear: nn.Linear, group_size: int | None, dispatcher: Dispatcher | None) -> QuantLinear:
        return W8A8Linear(linear.in_features, linear.out_features, **_module_kwargs(linear, dispatcher))


SCHEMES: Mapping[str, type[QuantScheme]] = MappingProxyType(
    {
        "none": NoQuant,
        "int8": Int8Scheme,
        "int4": Int4Scheme,
        "int2": Int2Scheme,
        "w8a8": W8A8Scheme,
    }
)


def get_scheme(name: str, **options: object) -> QuantScheme:
    """The scheme for a config string ("none", "int8", "int4", "int2", "w8a8"); options go to its constructor
    (e.g. symmetric=True for int4, act_absmax=... for w8a8)."""
    try:
        cls = SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown quantization scheme {name!r}; valid: {', '.join(SCHEMES)}") from None
    return cls(**options)
