"""Find the model folder; a GGUF (the embedded default) is prepared once (config, tokenizer, tensor table). Then
check the settings against the model (config_check.check_prepared) before any later stage does heavy work."""

from __future__ import annotations

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import MODEL
from glowplug.engine.config_check import check_prepared
from glowplug.engine.models.arch import ModelError, load_arch
from glowplug.engine.models.loader import resolve_dtype
from glowplug.engine.models.store import (
    gguf_file_for,
    gguf_source,
    gguf_table,
    model_factors,
    prepare_model,
    source_quant_block,
)
from glowplug.engine.start_estimate import HIT, MISS
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport


class ModelPrepare:
    name = "model_prepare"
    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ("model_dir", "gguf_path", "arch", "dtype")
    caches: tuple[str, ...] = ("model",)

    def cache_probe(self, ctx: EngineContext) -> dict[str, str]:
        """For the ETA (engine/start_estimate.py): whether the prepared folder is stored, and, when it is (or the
        model is a local folder), the folder, architecture and dtype the later stages' probes key on."""
        source = gguf_source(ctx.config.model)
        if source is None:
            model_dir, _ = prepare_model(ctx.config.model, ctx.cache_root, quiet=True)  # a folder: nothing to prepare
            state: dict[str, str] = {}
        else:
            store = ArtifactStore(ctx.cache_root)
            factors = model_factors(source)
            if not store.probe(MODEL, factors):
                return {"model": MISS}
            model_dir, state = store.entry_path(MODEL, store.key(MODEL, factors)), {"model": HIT}
        ctx.model_dir = model_dir
        ctx.gguf_path = source if source is not None else gguf_file_for(model_dir)  # as `run` finds it
        ctx.arch = load_arch(model_dir)
        ctx.dtype = resolve_dtype(
            ctx.config.dtype,
            ctx.arch,
            ctx.device,
            quantized_source=source_quant_block(model_dir) is not None,
            compiled=ctx.config.compile_enabled(),
        )
        return state

    def run(self, ctx: EngineContext) -> StageReport:
        ctx.model_dir, fetched = prepare_model(ctx.config.model, ctx.cache_root, quiet=True)
        ctx.arch = load_arch(ctx.model_dir)
        # A folder glowplug prepared from a GGUF, passed as a path (tools and tests do), reads the same GGUF.
        ctx.gguf_path = gguf_source(ctx.config.model) if fetched is not None else gguf_file_for(ctx.model_dir)
        if ctx.gguf_path is None and gguf_table(ctx.model_dir) is not None:
            raise ModelError(
                f"{ctx.model_dir} was prepared from a GGUF file that is no longer there; pass the "
                f".gguf file (or `smollm2`) instead of this folder"
            )
        ctx.dtype = resolve_dtype(
            ctx.config.dtype,
            ctx.arch,
            ctx.device,
            quantized_source=source_quant_block(ctx.model_dir) is not None,
            compiled=ctx.config.compile_enabled(),
        )
        # Here, not in a later stage: a setting the model cannot take fails before the weights are read, the
        # graphs compiled or the KV cache profiled, with the flag and the fix in the message.
        check_prepared(ctx)
        attrs: dict[str, object] = {
            Attr.MODEL_DIR: str(ctx.model_dir),
            Attr.MODEL_TYPE: ctx.arch.model_type,
            Attr.DTYPE: str(ctx.dtype).removeprefix("torch."),
        }
        # A local folder involves no cache: it is "hit" in the sense that nothing had to be prepared.
        attrs.update(fetched.attributes() if fetched is not None else {Attr.CACHE_HIT: True})
        return StageReport(attributes=attrs)  # type: ignore[arg-type]
