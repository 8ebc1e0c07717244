"""Trace the decode step with Dynamo (no Inductor yet: that is graph_compile's time)."""

from __future__ import annotations

import torch

from ...profiling.names import Attr
from ..attention import AttentionMetadata
from ..compile import DeferredInductor, make_decode_fn
from ..compile_cache import open_compile_cache
from ..kv_cache import KVCache
from .base import StageReport
from .context import EngineContext

TRACE_BATCH = 2  # >= 2 so Dynamo does not specialise the batch dimension to 1
TRACE_WIDTH = 3  # block-table width; distinct from TRACE_BATCH so the two dims get separate symbols
TRACE_BLOCKS = 5  # scratch cache blocks; distinct again


def dummy_decode_inputs(
    cache: KVCache, batch: int, block: int, *, mark_dynamic: bool = False
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode batch whose every row reads and writes only `block` (the scratch block).

    mark_dynamic: declare exactly the dims that vary between steps (batch, block-table width, cache blocks) as
    symbolic; everything else (layers, heads, head_dim, block_size) stays static for better code.
    """
    meta = AttentionMetadata(
        prefill_info=torch.zeros((0, 3), dtype=torch.long),
        prefill_block_tables=torch.zeros((0, 0), dtype=torch.long),
        kv_cache=cache,
        slot_mapping=torch.full((batch,), block * cache.block_size, dtype=torch.long),
        decode_block_tables=torch.full((batch, TRACE_WIDTH), block, dtype=torch.long),
        decode_ctx_lens=torch.ones(batch, dtype=torch.long),
    )
    ids = torch.zeros(batch, dtype=torch.long)
    pos = torch.zeros(batch, dtype=torch.long)
    if mark_dynamic:
        mark = torch._dynamo.mark_dynamic
        for t in (ids, pos, meta.slot_mapping, meta.decode_ctx_lens):
            mark(t, 0)
        assert meta.decode_block_tables is not None
        mark(meta.decode_block_tables, 0)
        mark(meta.decode_block_tables, 1)
        for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
            if t is not None:
                mark(t, 1)
    return ids, pos, meta


class DynamoTransform:
    name = "dynamo_transform"

    def run(self, ctx: EngineContext) -> StageReport:
        if not ctx.config.compile_enabled():
            return StageReport.skipped(f"--compile {ctx.config.compile}" + (" (CPU)" if ctx.config.compile == "auto" else ""))
        model = ctx.need(ctx.model, "the model", "model_init")
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        ctx.compile_cache = open_compile_cache(ctx.cache_root, ctx.config, arch, ctx.dtype, ctx.device)
        ctx.backend = DeferredInductor()
        ctx.decode_fn = make_decode_fn(model, ctx.backend)
        # A small scratch cache stands in for the real one (not allocated yet); its sizes are symbolic in the
        # traced graph, so the real cache reuses it.
        scratch = KVCache(
            num_layers=arch.num_hidden_layers,
            num_blocks=TRACE_BLOCKS,
            block_size=ctx.config.cache.block_size,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            dtype=ctx.dtype,
            device=ctx.device,
            int8=ctx.config.cache.kv_cache_dtype == "int8",
        )
        with torch.inference_mode():
            ctx.decode_fn(*dummy_decode_inputs(scratch, TRACE_BATCH, TRACE_BLOCKS - 1, mark_dynamic=True))
        return StageReport(
            attributes={
                "glowplug.graphs_traced": len(ctx.backend.graphs),
                Attr.CACHE_KEY: ctx.compile_cache.key,
            }
        )
