"""Quantize the checkpoint's projections (round to nearest) for the configured scheme, cached in the artifact store.

A warm start maps the cached quantized tensors instead of quantizing again. Only the tensors the scheme adds are
cached; everything it leaves alone (embeddings, norms) still comes from the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ...profiling.names import Attr
from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import QUANT, file_stamps, source_digest
from ..models.loader import checkpoint_files
from ..models.store import gguf_table, model_group
from ..start_estimate import HIT, MISS
from .base import StageReport
from .context import EngineContext

QUANTIZED = "quantized.safetensors"


def quant_factors(ctx: EngineContext) -> dict[str, Any]:
    """What the quantized tensors depend on: the checkpoint's bytes, the scheme and its grouping, and the code and
    torch build that pack them (packed int4 layouts are torch-version specific)."""
    model_dir = ctx.need(ctx.model_dir, "the model folder", "model_prepare")
    from_gguf = ctx.gguf_path is not None and gguf_table(model_dir) is not None
    return {
        "checkpoint": file_stamps([ctx.gguf_path] if from_gguf else checkpoint_files(model_dir)),
        "scheme": ctx.config.quant.quantization,
        "group_size": ctx.quant_group_size()[0],
        "quantize_lm_head": ctx.config.quant.quantize_lm_head,
        # The state dict quantized is the fused one (engine/models/llama.py FUSED_MODULES).
        "layout": "fused:qkv_proj,gate_up_proj",
        "torch": torch.__version__,
        "kernels_source": source_digest(["kernels"]),
    }


class QuantizeWeights:
    name = "quantize_weights"
    needs: tuple[str, ...] = ("model_dir", "gguf_path", "state_dict")
    provides: tuple[str, ...] = ("state_dict", "weights_bytes")
    caches: tuple[str, ...] = ("quant",)

    def cache_probe(self, ctx: EngineContext) -> dict[str, str]:
        """For the ETA: whether the quantized tensors are stored (nothing to say for quantization none). A
        checkpoint whose projections all come repacked from GGUF blocks stores nothing and probes as a miss at
        every start, so its pattern stays the same from start to start."""
        if ctx.config.quant.quantization == "none":
            return {}
        return {"quant": HIT if ArtifactStore(ctx.cache_root).probe(QUANT, quant_factors(ctx)) else MISS}

    def run(self, ctx: EngineContext) -> StageReport:
        q = ctx.config.quant
        if q.quantization == "none":
            return StageReport.skipped("quantization none", {Attr.QUANTIZATION: "none"})
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
            return StageReport(attributes={
                Attr.QUANTIZATION: q.quantization,
                "glowplug.quantized_bytes": scheme.weight_bytes(sd, only_linear=True),
                "glowplug.group_size": str(scheme.resolve_group_size(group_size)),
                "glowplug.group_size_reason": why, "glowplug.quantize_lm_head": head,
                "glowplug.quantized_from": "GGUF blocks, repacked on their own grid",
            })  # fmt: skip

        def build(folder: Path | None) -> dict[str, torch.Tensor]:
            # Quantize from fp32 so the result does not depend on the serving dtype's rounding.
            merged = scheme.quantize_state_dict(sd, group_size=group_size, quantize_head=head)
            added = {k: v.contiguous() for k, v in merged.items() if k not in sd}
            if folder is not None:
                save_file(added, str(folder / QUANTIZED))
            return added

        fetched = ArtifactStore(ctx.cache_root).fetch(
            QUANT, quant_factors(ctx), group=model_group(ctx.config.model), build=build,
            load=lambda folder: load_file(str(folder / QUANTIZED)),
        )  # fmt: skip
        added = fetched.value
        replaced = {k.rsplit(".", 1)[0] for k in added}
        merged = {k: v for k, v in sd.items() if not (k.endswith(".weight") and k[: -len(".weight")] in replaced)}
        merged.update(added)
        ctx.state_dict = merged
        ctx.weights_bytes = sum(t.nbytes for t in merged.values())
        attrs: dict[str, object] = {Attr.QUANTIZATION: q.quantization, **fetched.attributes()}
        attrs["glowplug.quantized_bytes"] = scheme.weight_bytes(merged, only_linear=True)
        attrs["glowplug.bits_per_weight"] = round(scheme.bits_per_weight(group_size), 3)
        attrs["glowplug.group_size"] = str(scheme.resolve_group_size(group_size))
        attrs["glowplug.group_size_reason"] = why
        attrs["glowplug.quantize_lm_head"] = head
        return StageReport(attributes=attrs)
