"""Allocate the KV cache and assemble the engine (block manager, scheduler, runner)."""

from __future__ import annotations

import dataclasses

from glowplug.engine.kv_cache import KVCache
from glowplug.engine.llm_engine import LLMEngine
from glowplug.engine.model_runner import ModelRunner
from glowplug.engine.scheduler import Scheduler
from glowplug.engine.tokenizer import eos_token_ids
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport


class KVCacheInit:
    name = "kv_cache_init"
    # parallel: under tensor parallelism the ranks agree on one block count (each sized its budget on its own).
    needs: tuple[str, ...] = ("kv_plan", "arch", "model", "tokenizer", "model_dir", "dtype", "parallel", "grammar")
    provides: tuple[str, ...] = ("kv_cache", "runner", "engine")

    def run(self, ctx: EngineContext) -> StageReport:
        plan = ctx.need(ctx.kv_plan, "the KV plan", "kv_cache_profiling")
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        model = ctx.need(ctx.model, "the model", "model_init")
        if ctx.parallel is not None:
            # Rank 0's scheduler hands out block ids that every rank's cache must hold.
            agreed = ctx.parallel.agree_min(plan.num_blocks)
            if agreed != plan.num_blocks:
                plan = dataclasses.replace(plan, num_blocks=agreed)
        ctx.kv_cache = KVCache(
            num_layers=arch.num_hidden_layers,
            num_blocks=plan.num_blocks + 1,  # +1: the runner's scratch block for padded rows
            block_size=plan.block_size,
            # A rank's cache holds its KV heads only (engine/parallel.py).
            num_kv_heads=ctx.tp_shard().local_arch(arch).num_key_value_heads,
            head_dim=arch.head_dim,
            dtype=ctx.dtype,
            device=ctx.device,
            int8=ctx.config.cache.kv_cache_dtype == "int8",
        )
        ctx.runner = ModelRunner(
            model,
            ctx.kv_cache,
            ctx.device,
            max_num_seqs=ctx.config.scheduler.max_num_seqs,
            max_blocks_per_seq=-(-plan.max_model_len // plan.block_size),
        )
        assert ctx.model_dir is not None
        scheduler = Scheduler(
            ctx.config.scheduler,
            ctx.config.cache,
            plan.num_blocks,
            plan.max_model_len,
            eos_token_ids(ctx.tokenizer, arch, ctx.model_dir),
        )
        ctx.engine = LLMEngine(
            tokenizer=ctx.tokenizer, runner=ctx.runner, scheduler=scheduler, seed=ctx.config.seed, grammar=ctx.grammar
        )
        return StageReport(
            attributes={
                Attr.KV_BLOCKS: plan.num_blocks,
                Attr.KV_CACHE_BYTES: ctx.kv_cache.nbytes,
                Attr.KV_CACHE_DTYPE: ctx.config.cache.kv_cache_dtype,
            }
        )
