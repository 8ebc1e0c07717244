"""A real generation of a few tokens: READY means the whole path, sampling included, has run once."""

from __future__ import annotations

from ..sampling_params import SamplingParams
from .base import StageReport
from .context import EngineContext

WARMUP_TOKENS = 4


class Warmup:
    name = "warmup"
    needs: tuple[str, ...] = ("engine", "runner")
    provides: tuple[str, ...] = ()

    def run(self, ctx: EngineContext) -> StageReport:
        engine = ctx.need(ctx.engine, "the engine", "kv_cache_init")
        prompt = list(engine.tokenizer("glowplug warm-up")["input_ids"]) or [0]
        params = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
        # Two sequences, so both a batch-1 prefill and a batched decode step run before READY.
        reqs = [engine.add_request(None, params, prompt_token_ids=prompt, request_id=f"warmup-{i}") for i in range(2)]
        generated = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    generated += len(out.outputs[0].token_ids)
        stats = engine.stats()
        if stats.kv_used_blocks:
            raise RuntimeError(f"warm-up leaked {stats.kv_used_blocks} KV blocks")
        return StageReport(attributes={"glowplug.warmup_tokens": generated, "glowplug.warmup_requests": len(reqs)})
