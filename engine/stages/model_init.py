"""Build the decoder on the meta device and assign the (possibly quantized) weights into it, without copies.

Under --quantization auto each layer is converted to its own format (engine/models/gguf_auto.py): one model whose
layers run int4, int8 or dense kernels as the GGUF stores them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from glowplug.engine.models.gguf_auto import LayerFormats
from glowplug.engine.models.loader import build_meta_model, install_stored, materialize
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport

if TYPE_CHECKING:
    from glowplug.kernels.dispatch import Dispatcher


def layer_shapes(ctx: EngineContext) -> list[tuple[int, int]]:
    """(N, K) of every distinct projection the quantizer converts: the fused layer projections and the head."""
    arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
    return arch.projection_shapes(ctx.config.quant.quantize_lm_head)


def kernel_dispatcher(ctx: EngineContext) -> tuple[Dispatcher, str]:
    """The dispatcher for the quantized layers: the table `glowplug bench kernels` calibrated on this machine for
    these shapes when there is one, else the built-in rules (the measured facts in the kernel notes)."""
    from glowplug.kernels.dispatch import DEFAULT_FORMATS, DEFAULT_MS, Dispatcher, calibration_factors, lookup_table

    found = lookup_table(ctx.cache_root, calibration_factors(layer_shapes(ctx), DEFAULT_FORMATS, DEFAULT_MS))
    if found.value is not None:
        return Dispatcher(found.value), f"calibrated (kernel_dispatch {found.key})"
    return Dispatcher(), f"default rules ({found.miss_reason}; `glowplug bench kernels` calibrates)"


def _not_in(formats: LayerFormats, scheme: str) -> Callable[[str], bool]:
    """The converter's skip callback for one scheme: every module the plan puts in another format (or none)."""
    return lambda module: formats.scheme_of(module) != scheme


class ModelInit:
    name = "model_init"
    needs: tuple[str, ...] = ("arch", "dtype", "model_dir", "state_dict", "gguf_stored")
    # It drops the state dict and the stored rows once the model owns the tensors.
    provides: tuple[str, ...] = ("model", "state_dict", "gguf_stored")

    def run(self, ctx: EngineContext) -> StageReport:
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        sd = ctx.need(ctx.state_dict, "the checkpoint", "load_weights")
        model = build_meta_model(arch, ctx.tp_shard())
        keep: frozenset[str] = frozenset()
        stored_bytes = 0
        table_source = "n/a (not quantized)"
        q = ctx.config.quant
        scheme_name = ctx.quant_scheme()
        if scheme_name != "none":
            from glowplug.kernels.modules import QuantLinear
            from glowplug.kernels.registry import get_scheme

            dispatcher, table_source = kernel_dispatcher(ctx)
            group_size, _ = ctx.quant_group_size()
            formats = ctx.layer_formats() if scheme_name == "auto" else None
            if formats is not None:
                # The layers run in place are built from their stored rows; then one conversion per scheme in use,
                # each over its own layers: a mixed file runs mixed.
                if formats.in_place() or formats.embedding_in_place:
                    stored = ctx.need(ctx.gguf_stored, "the stored GGUF rows", "load_weights")
                    stored_bytes = install_stored(model, formats, stored, ctx.dtype)
                head = formats.head_scheme not in ("none", "gguf")
                if head:
                    model.untie_head_for_quantization()
                for name in formats.schemes():
                    get_scheme(name).convert_for_runtime(
                        model,
                        group_size=group_size,
                        dispatcher=dispatcher,
                        quantize_head=head,
                        skip=_not_in(formats, name),
                    )
            else:
                if q.quantize_lm_head:
                    model.untie_head_for_quantization()
                get_scheme(scheme_name).convert_for_runtime(
                    model, group_size=group_size, dispatcher=dispatcher, quantize_head=q.quantize_lm_head
                )
            keep = frozenset(
                f"{name}.{buf}"
                for name, mod in model.named_modules()
                if isinstance(mod, QuantLinear)
                for buf, _ in mod.named_buffers(recurse=False)
            )
        assert ctx.model_dir is not None
        materialize(model, sd, ctx.dtype, ctx.device, ctx.model_dir, keep_dtype=keep)
        model.model.build_rope(arch.max_position_embeddings, ctx.device)
        ctx.model = model
        ctx.state_dict = None  # the model owns the tensors now; drop the extra references
        ctx.gguf_stored = None
        return StageReport(
            attributes={
                Attr.KERNEL_DISPATCH: table_source,
                Attr.PARAM_COUNT: arch.num_params,
                Attr.DTYPE: str(ctx.dtype).removeprefix("torch."),
                Attr.QUANTIZATION: q.quantization,
                Attr.WEIGHTS_BYTES: sum(t.nbytes for t in model.state_dict().values()) + stored_bytes,
            }
        )
