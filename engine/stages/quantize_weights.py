"""Quantize the checkpoint's projections (round to nearest) for the configured scheme, cached in the artifact store.

A warm start maps the cached quantized tensors instead of quantizing again. Only the tensors the scheme adds are
cached; everything it leaves alone (embeddings, norms) still comes from the checkpoint. Under --quantization auto
only the layers whose GGUF type has no exact layout are quantized here, each to its own scheme
(engine/models/gguf_auto.py), and only those are cached; the row's note says what every class of tensor became.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from glowplug.base.artifacts import ArtifactStore, Fetched
from glowplug.base.artifacts.caches import QUANT, file_stamps, source_digest
from glowplug.engine.models.loader import checkpoint_files
from glowplug.engine.models.store import gguf_table
from glowplug.engine.parallel import tp_factors
from glowplug.engine.start_estimate import HIT, MISS
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport

QUANTIZED = "quantized.safetensors"


def quant_factors(ctx: EngineContext) -> dict[str, Any]:
    """What the quantized tensors depend on: the checkpoint's bytes, the scheme and its grouping, and the code and
    torch build that pack them (packed int4 layouts are torch-version specific)."""
    model_dir = ctx.need(ctx.model_dir, "the model folder", "model_prepare")
    from_gguf = ctx.gguf_path is not None and gguf_table(model_dir) is not None
    factors: dict[str, Any] = {
        "checkpoint": file_stamps([ctx.gguf_path] if from_gguf else checkpoint_files(model_dir)),  # type: ignore[list-item]
        "scheme": ctx.config.quant.quantization,
        "group_size": ctx.quant_group_size()[0],
        "quantize_lm_head": ctx.config.quant.quantize_lm_head,
        # The state dict quantized is the fused one (engine/models/llama.py FUSED_MODULES).
        "layout": "fused:qkv_proj,gate_up_proj",
        "torch": torch.__version__,
        "kernels_source": source_digest(["kernels"]),
        **tp_factors(ctx.config.tensor_parallel_size),  # each rank quantizes (and stores) its own shard
    }
    formats = ctx.layer_formats()
    if formats is not None:
        # auto stores only the layers it re-quantizes (the exact repacks are the file's own bytes, read at every
        # start): which ones, and to what, is what the entry holds.
        factors["requantized"] = sorted(f"{m} {s}" for m, s in formats.requantize().items())
    return factors


def _fetch_quantized(
    ctx: EngineContext, quantize: Callable[[], dict[str, torch.Tensor]]
) -> Fetched[dict[str, torch.Tensor]]:
    """The tensors `quantize` adds to the checkpoint, from the quant cache: computed and stored on a miss."""

    def build(folder: Path | None) -> dict[str, torch.Tensor]:
        added = quantize()
        if folder is not None:
            save_file(added, str(folder / QUANTIZED))
        return added

    def load(folder: Path) -> dict[str, torch.Tensor]:
        return load_file(str(folder / QUANTIZED))

    return ctx.fetch_entry(QUANT, quant_factors(ctx), build=build, load=load)


def _swap_in(
    ctx: EngineContext, sd: dict[str, torch.Tensor], added: dict[str, torch.Tensor], replaced: Collection[str]
) -> dict[str, torch.Tensor]:
    """`sd` with the float weights of the `replaced` modules swapped for the quantized tensors `added`: the state
    dict (and weight bytes) the later stages get."""
    merged = {k: v for k, v in sd.items() if not (k.endswith(".weight") and k[: -len(".weight")] in replaced)}
    merged.update(added)
    ctx.state_dict = merged
    ctx.weights_bytes = sum(t.nbytes for t in merged.values())
    return merged


class QuantizeWeights:
    name = "quantize_weights"
    # dtype: only for the words of auto's row note (what the float layers run in).
    needs: tuple[str, ...] = ("model_dir", "gguf_path", "state_dict", "dtype")
    provides: tuple[str, ...] = ("state_dict", "weights_bytes")
    caches: tuple[str, ...] = ("quant",)

    def cache_probe(self, ctx: EngineContext) -> dict[str, str]:
        """For the ETA: whether the quantized tensors are stored (nothing to say for quantization none, or for
        auto when every quantized layer is repacked exactly: nothing is stored). A checkpoint whose projections
        all come repacked from GGUF blocks under an explicit scheme stores nothing and probes as a miss at every
        start, so its pattern stays the same from start to start."""
        scheme = ctx.quant_scheme()
        if scheme == "none":
            return {}
        if scheme == "auto":
            formats = ctx.layer_formats()
            if formats is None or not formats.requantize():
                return {}
        return {"quant": HIT if ArtifactStore(ctx.cache_root).probe(QUANT, quant_factors(ctx)) else MISS}

    def run(self, ctx: EngineContext) -> StageReport:
        q = ctx.config.quant
        scheme_name = ctx.quant_scheme()
        if scheme_name == "none":
            if q.quantization == "auto":
                return StageReport.skipped(
                    "quantization none (auto: the checkpoint's weights are floats, run as stored)",
                    {Attr.QUANTIZATION: "auto"},
                )
            return StageReport.skipped("quantization none", {Attr.QUANTIZATION: "none"})
        if scheme_name == "auto":
            return self._auto(ctx)
        from glowplug.kernels.registry import get_scheme, is_target_module

        sd = ctx.need(ctx.state_dict, "the checkpoint", "load_weights")
        scheme = get_scheme(q.quantization)
        group_size, why = ctx.quant_group_size()
        head = q.quantize_lm_head
        if head and "lm_head.weight" not in sd:
            # A tied head: its quantized copy is made from the embedding matrix (which stays for the lookup).
            sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}

        if not any(k.endswith(".weight") and is_target_module(k[: -len(".weight")], quantize_head=head) for k in sd):
            # Every projection came repacked from the GGUF's blocks (load_weights): nothing to quantize or cache.
            # The state dict goes on unchanged (`sd` is still load_weights' dict: adding a tied head would have left
            # the head to quantize); stored back, since a stage writes every slot it provides.
            ctx.state_dict = sd
            ctx.weights_bytes = sum(t.nbytes for t in sd.values())
            return StageReport(
                attributes={
                    Attr.QUANTIZATION: q.quantization,
                    Attr.QUANTIZED_BYTES: scheme.weight_bytes(sd, only_linear=True),
                    Attr.GROUP_SIZE: str(scheme.resolve_group_size(group_size)),
                    Attr.GROUP_SIZE_REASON: why,
                    Attr.QUANTIZE_LM_HEAD: head,
                    Attr.QUANTIZED_FROM: "GGUF blocks, repacked on their own grid",
                }
            )

        def quantize() -> dict[str, torch.Tensor]:
            # Quantize from fp32 so the result does not depend on the serving dtype's rounding.
            merged = scheme.quantize_state_dict(sd, group_size=group_size, quantize_head=head)
            return {k: v.contiguous() for k, v in merged.items() if k not in sd}

        fetched = _fetch_quantized(ctx, quantize)
        merged = _swap_in(ctx, sd, fetched.value, {k.rsplit(".", 1)[0] for k in fetched.value})
        attrs: dict[str, object] = {Attr.QUANTIZATION: q.quantization, **fetched.attributes()}
        attrs[Attr.QUANTIZED_BYTES] = scheme.weight_bytes(merged, only_linear=True)
        attrs[Attr.BITS_PER_WEIGHT] = round(scheme.bits_per_weight(group_size), 3)
        attrs[Attr.GROUP_SIZE] = str(scheme.resolve_group_size(group_size))
        attrs[Attr.GROUP_SIZE_REASON] = why
        attrs[Attr.QUANTIZE_LM_HEAD] = head
        return StageReport(attributes=attrs)  # type: ignore[arg-type]

    def _auto(self, ctx: EngineContext) -> StageReport:
        """--quantization auto: quantize (group 32) only the layers the plan re-quantizes, each to its own scheme,
        caching those; the exact repacks and the float layers pass through as load_weights made them."""
        from glowplug.engine.models.gguf_auto import AUTO_GROUP, EMBEDDING, HEAD
        from glowplug.kernels.registry import get_scheme

        formats = ctx.need(ctx.layer_formats(), "the auto plan (a GGUF's tensor table)", "model_prepare")
        sd = ctx.need(ctx.state_dict, "the checkpoint", "load_weights")
        targets = formats.requantize()
        if HEAD in targets and f"{HEAD}.weight" not in sd:
            # A tied head: its quantized copy is made from the embedding matrix (which stays for the lookup).
            sd = {**sd, f"{HEAD}.weight": sd[EMBEDDING]}

        def quantize() -> dict[str, torch.Tensor]:
            added: dict[str, torch.Tensor] = {}
            for name in sorted(set(targets.values())):
                # Quantized from fp32 (load_weights loaded these in fp32), as the explicit schemes do.
                part = {f"{m}.weight": sd[f"{m}.weight"] for m, s in targets.items() if s == name}
                quantized = get_scheme(name).quantize_state_dict(part, group_size=AUTO_GROUP, quantize_head=True)
                added.update({k: v.contiguous() for k, v in quantized.items() if k not in part})
            return added

        attrs: dict[str, object] = {Attr.QUANTIZATION: "auto"}
        if targets:
            fetched = _fetch_quantized(ctx, quantize)
            added = fetched.value
            attrs.update(fetched.attributes())
        else:
            added = {}  # every quantized layer came repacked from the GGUF's blocks: nothing to quantize or cache
        merged = _swap_in(ctx, sd, added, targets)
        counts = formats.counts()
        attrs.update(
            {
                # What each class of tensor became; the phase table prints it on this row.
                Attr.ROW_NOTE: formats.note(str(ctx.dtype).removeprefix("torch.")),
                Attr.LAYER_FORMATS: formats.signature(),
                Attr.AUTO_INT4_LAYERS: counts["int4"],
                Attr.AUTO_INT8_LAYERS: counts["int8"],
                Attr.AUTO_DENSE_LAYERS: counts["dense"],
                Attr.AUTO_REPACKED_LAYERS: counts["repacked"],
                Attr.AUTO_REQUANTIZED_LAYERS: counts["re-quantized"],
                Attr.QUANTIZED_BYTES: sum(
                    t.nbytes for k, t in merged.items() if k.rpartition(".")[2] in ("qweight", "scales", "zeros")
                ),
                Attr.GROUP_SIZE: str(AUTO_GROUP),
                Attr.GROUP_SIZE_REASON: ctx.quant_group_size()[1],
                Attr.QUANTIZE_LM_HEAD: ctx.config.quant.quantize_lm_head,
            }
        )
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
