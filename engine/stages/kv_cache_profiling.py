"""Measure the activation peak of one forward at max_num_batched_tokens and size the KV cache from the budget.

CUDA: torch's allocator peak. CPU: the RSS high-water mark (VmHWM, reset through /proc/self/clear_refs) over the
run, minus the RSS before it. On the CPU the budget's "device memory" is the RAM still available after the weights
were loaded, so the weights are not subtracted a second time. The result is cached by config hash: a warm start
reads it and skips the dummy run.
"""

from __future__ import annotations

import hashlib
import json

import torch

from ...profiling.memory import PeakMemory
from ...profiling.names import Attr
from ..attention import AttentionMetadata
from ..kv_sizing import plan_kv_cache
from .base import StageReport
from .context import EngineContext


def _profile_key(ctx: EngineContext) -> str:
    assert ctx.arch is not None
    parts = [ctx.config.compute_hash(), ctx.arch.compute_hash(), ctx.device, str(ctx.dtype), torch.__version__]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


class KVCacheProfiling:
    name = "kv_cache_profiling"

    def run(self, ctx: EngineContext) -> StageReport:
        model = ctx.need(ctx.model, "the model", "model_init")
        arch = ctx.need(ctx.arch, "the architecture", "model_prepare")
        key = _profile_key(ctx)
        path = ctx.cache_root / "profiles" / f"kv-{key}.json"
        cached = json.loads(path.read_text()) if path.is_file() else None
        if cached is not None:
            peak, method = int(cached["activation_peak_bytes"]), str(cached["method"])
        else:
            tokens = min(ctx.config.scheduler.max_num_batched_tokens, arch.max_position_embeddings)
            ids = torch.zeros(tokens, dtype=torch.long, device=ctx.device)
            pos = torch.arange(tokens, device=ctx.device)
            rows = min(ctx.config.scheduler.max_num_seqs, tokens)
            with torch.inference_mode(), PeakMemory(ctx.device) as window:
                hidden = model(ids, pos, AttentionMetadata.causal([tokens]))
                model.compute_logits(hidden[-rows:])
                del hidden
            assert window.snapshot is not None
            peak, method = window.snapshot.peak_increase_bytes, window.snapshot.method
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"activation_peak_bytes": peak, "method": method, "tokens": tokens}))
        weights = 0 if ctx.device == "cpu" else ctx.weights_bytes
        plan = plan_kv_cache(
            ctx.config, arch, model_dtype=ctx.dtype, device=ctx.device, weights_bytes=weights, activation_peak_bytes=peak
        )
        ctx.kv_plan = plan
        attrs: dict[str, object] = {
            Attr.PEAK_MEMORY_BYTES: peak,
            "glowplug.memory_method": method,
            Attr.KV_BLOCKS: plan.num_blocks,
            Attr.KV_TOKEN_CAPACITY: plan.token_capacity,
            Attr.MAX_CONCURRENCY: round(plan.max_concurrency, 2),
            Attr.MAX_MODEL_LEN: plan.max_model_len,
            "glowplug.kv_budget_bytes": plan.budget_bytes,
            "glowplug.kv_budget_source": plan.budget_source,
            Attr.CACHE_HIT: cached is not None,
            Attr.CACHE_KEY: key,
        }
        return StageReport(attributes=attrs, skipped_reason="cache hit" if cached is not None else None)
