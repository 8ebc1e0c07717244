"""Build the decoder on the meta device and assign the (possibly quantized) weights into it, without copies."""

from __future__ import annotations

from ...profiling.names import Attr
from ..models.loader import build_meta_model, materialize
from .base import StageReport
from .context import EngineContext


class ModelInit:
    name = "model_init"

    def run(self, ctx: EngineContext) -> StageReport:
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        sd = ctx.need(ctx.state_dict, "the checkpoint", "load_weights")
        model = build_meta_model(arch)
        keep: frozenset[str] = frozenset()
        q = ctx.config.quant
        if q.quantization != "none":
            from glowplug.kernels.modules import QuantLinear
            from glowplug.kernels.registry import get_scheme

            get_scheme(q.quantization).convert_for_runtime(model, group_size=q.group_size)
            keep = frozenset(
                f"{name}.{buf}"
                for name, mod in model.named_modules()
                if isinstance(mod, QuantLinear)
                for buf, _ in mod.named_buffers(recurse=False)
            )
        assert ctx.model_dir is not None
        materialize(model, sd, ctx.dtype, ctx.device, ctx.model_dir, keep_dtype=keep)
        model.model.rotary_emb.build(arch.max_position_embeddings, ctx.device)
        ctx.model = model
        ctx.state_dict = None  # the model owns the tensors now; drop the extra references
        return StageReport(
            attributes={
                Attr.PARAM_COUNT: arch.num_params,
                Attr.DTYPE: str(ctx.dtype).removeprefix("torch."),
                Attr.QUANTIZATION: q.quantization,
                "glowplug.weights_bytes": sum(t.nbytes for t in model.state_dict().values()),
            }
        )
