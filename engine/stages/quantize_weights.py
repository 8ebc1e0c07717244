"""Quantize the checkpoint's projections (round to nearest) for the configured scheme, cached by hash.

A warm start maps the cached quantized tensors instead of quantizing again. Only the tensors the scheme adds are
cached; everything it leaves alone (embeddings, norms) still comes from the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...profiling.names import Attr
from .base import StageReport
from .context import EngineContext


def _kernels_source_hash() -> str:
    import glowplug.kernels as k

    h = hashlib.sha256()
    for root in k.__path__:
        for f in sorted(Path(root).rglob("*.py")):
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def quant_cache_key(ctx: EngineContext) -> tuple[str, dict[str, str]]:
    assert ctx.model_dir is not None
    files = sorted(ctx.model_dir.glob("*.safetensors"))
    factors = {
        "checkpoint": ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files),
        "model_dir": str(ctx.model_dir),
        "scheme": ctx.config.quant.quantization,
        "group_size": str(ctx.quant_group_size()[0]),
        "quantize_lm_head": str(ctx.config.quant.quantize_lm_head),
        # The state dict quantized is the fused one (engine/models/llama.py FUSED_MODULES).
        "layout": "fused:qkv_proj,gate_up_proj",
        "torch": torch.__version__,
        "kernels_source": _kernels_source_hash(),
    }
    key = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:16]
    return key, factors


class QuantizeWeights:
    name = "quantize_weights"

    def run(self, ctx: EngineContext) -> StageReport:
        q = ctx.config.quant
        if q.quantization == "none":
            return StageReport.skipped("quantization none", {Attr.QUANTIZATION: "none"})
        from glowplug.kernels.registry import get_scheme

        sd = ctx.need(ctx.state_dict, "the checkpoint", "load_weights")
        scheme = get_scheme(q.quantization)
        group_size, why = ctx.quant_group_size()
        key, factors = quant_cache_key(ctx)
        folder = ctx.cache_root / "quant" / key
        path = folder / "quantized.safetensors"
        attrs: dict[str, object] = {Attr.QUANTIZATION: q.quantization, Attr.CACHE_KEY: key}
        head = q.quantize_lm_head
        if head and "lm_head.weight" not in sd:
            # A tied head: its quantized copy is made from the embedding matrix (which stays for the lookup).
            sd = {**sd, "lm_head.weight": sd["model.embed_tokens.weight"]}
        if path.is_file():
            added = load_file(str(path))
            replaced = {k.rsplit(".", 1)[0] for k in added}
            merged = {k: v for k, v in sd.items() if not (k.endswith(".weight") and k[: -len(".weight")] in replaced)}
            merged.update(added)
            attrs[Attr.CACHE_HIT] = True
        else:
            # Quantize from fp32 so the result does not depend on the serving dtype's rounding.
            merged = scheme.quantize_state_dict(sd, group_size=group_size, quantize_head=head)
            added = {k: v.contiguous() for k, v in merged.items() if k not in sd}
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            save_file(added, str(tmp))
            (folder / "manifest.json").write_text(json.dumps(factors, indent=2, sort_keys=True))
            os.replace(tmp, path)  # atomic: a crashed start never leaves a half-written cache entry
            attrs[Attr.CACHE_HIT] = False
        ctx.state_dict = merged
        ctx.weights_bytes = sum(t.nbytes for t in merged.values())
        attrs["glowplug.quantized_bytes"] = scheme.weight_bytes(merged, only_linear=True)
        attrs["glowplug.bits_per_weight"] = round(scheme.bits_per_weight(group_size), 3)
        attrs["glowplug.group_size"] = str(scheme.resolve_group_size(group_size))
        attrs["glowplug.group_size_reason"] = why
        attrs["glowplug.quantize_lm_head"] = head
        return StageReport(attributes=attrs)
