"""Find the model folder; the embedded default is converted from GGUF once (a cache hit afterwards)."""

from __future__ import annotations

from ...profiling.names import Attr
from ..models.arch import load_arch
from ..models.loader import resolve_dtype
from ..models.store import is_prepared, resolve_model, source_quant_block
from .base import StageReport
from .context import EngineContext


class ModelPrepare:
    name = "model_prepare"

    def run(self, ctx: EngineContext) -> StageReport:
        hit = is_prepared(ctx.config.model, ctx.cache_root)
        ctx.model_dir = resolve_model(ctx.config.model, ctx.cache_root, quiet=True)
        ctx.arch = load_arch(ctx.model_dir)
        ctx.dtype = resolve_dtype(
            ctx.config.dtype, ctx.arch, ctx.device, quantized_source=source_quant_block(ctx.model_dir) is not None
        )
        return StageReport(
            attributes={
                "glowplug.model_dir": str(ctx.model_dir),
                "glowplug.model_type": ctx.arch.model_type,
                Attr.CACHE_HIT: hit,
                Attr.DTYPE: str(ctx.dtype).removeprefix("torch."),
            }
        )
