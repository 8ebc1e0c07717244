"""A real generation of a few tokens: READY means the whole path, sampling included, has run once."""

from __future__ import annotations

from glowplug.engine.llm_engine import LLMEngine
from glowplug.engine.sampling_params import SamplingParams
from glowplug.profiling.names import Attr

from .context import EngineContext
from .protocol import StageReport

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
        attrs: dict[str, object] = {Attr.WARMUP_TOKENS: generated, Attr.WARMUP_REQUESTS: len(reqs)}
        attrs.update(memory_at_ready(engine))
        return StageReport(attributes=attrs)  # type: ignore[arg-type]


def memory_at_ready(engine: LLMEngine) -> dict[str, object]:
    """The process's peak resident memory split into the model's weights, the KV pool and the rest (runtime), with
    the resident file-backed and anonymous pages; the row's note says it in one line. Empty off Linux."""
    from glowplug.base.residency import memory_resident_bytes
    from glowplug.profiling.memory import process_memory, unique_storage_bytes

    mem = process_memory()
    if mem is None:
        return {}
    model = engine.model
    weights = unique_storage_bytes([*model.parameters(), *model.buffers()])
    kv = engine.runner.kv_cache.nbytes if engine.runner.device.type == "cpu" else 0
    # The pool's pages are touched as sequences fill it: only its resident part is in the RSS.
    kv_resident = 0
    for t in engine.runner.kv_cache.tensors() if kv else []:
        got = memory_resident_bytes(t.data_ptr(), t.nbytes)
        kv_resident += t.nbytes if got is None else got
    runtime = mem.peak_rss_bytes - weights - kv_resident
    gb = 1e9
    return {
        Attr.MEMORY_PEAK_RSS: mem.peak_rss_bytes,
        Attr.MEMORY_RSS_FILE: mem.file_bytes,
        Attr.MEMORY_RSS_ANON: mem.anon_bytes,
        Attr.MEMORY_WEIGHTS: weights,
        Attr.MEMORY_KV_POOL: kv,
        Attr.MEMORY_KV_RESIDENT: kv_resident,
        Attr.MEMORY_RUNTIME: runtime,
        Attr.ROW_NOTE: (
            f"peak RSS {mem.peak_rss_bytes / gb:.2f} GB = weights {weights / gb:.2f} + KV pool "
            f"{kv_resident / gb:.2f} resident of {kv / gb:.2f} + runtime {runtime / gb:.2f} (now "
            f"{mem.file_bytes / gb:.2f} GB file-backed, {mem.anon_bytes / gb:.2f} GB anonymous)"
        ),
    }
