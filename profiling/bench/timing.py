"""Timing one batch through the engine, split into prefill and decode, plus the checks that decide whether a
batch shape can run at all (and the sentence that says why not).

The split is the one `decode.time_engine_decode` uses: prefill lasts until every sequence of the batch has its
first token; decode is everything after. Here each decode step is timed on its own as well (for per-token
percentiles), the sampling parameters are the caller's, and the clock starts before the requests are added, so
`prefill_s + decode_s` is the batch's end-to-end latency.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glowplug.engine.config import EngineConfig


@dataclass(frozen=True)
class BatchTiming:
    batch: int
    prompt_tokens: int  # summed over the batch
    generated_tokens: int  # summed over the batch
    prefill_s: float  # requests added -> every sequence has its first token
    decode_s: float  # from then until the last sequence finished
    prefill_steps: int  # engine steps the prefill took (> 1 when the step token budget chunks it)
    decode_step_s: tuple[float, ...]  # each decode step's wall time

    @property
    def latency_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the prefill (the first token of each sequence comes from its prefill)."""
        return self.generated_tokens - self.batch

    @property
    def output_tokens_per_s(self) -> float | None:
        """THE output (decode) throughput of every glowplug report: tokens after each sequence's first token over
        the time after the first tokens, `decode_tokens / decode_s`. Numerator and denominator cover the same
        interval: counting the first tokens (made inside `prefill_s`) over `decode_s` would inflate the rate by
        n/(n-1) for n tokens a sequence. Seed 001's decode row is this (batch x (decode length - 1) / Decode
        (total)). None when there was no decode phase (one token a sequence)."""
        return self.decode_tokens / self.decode_s if self.decode_tokens > 0 and self.decode_s > 0 else None

    @property
    def prefill_requests_per_s(self) -> float:
        """Seed 001's "Prefill" throughput (TGI labels it tokens/secs): sequences prefilled per second,
        batch / prefill time, i.e. first tokens per second. Not prompt tokens per second."""
        return self.batch / self.prefill_s

    @property
    def prefill_tokens_per_s(self) -> float:
        """glowplug's prefill throughput: prompt tokens (summed over the batch) / prefill time."""
        return self.prompt_tokens / self.prefill_s


def time_batch(engine: Any, prompts: list[list[int]], params: Any) -> BatchTiming:
    """Run `prompts` as one batch to completion on an idle engine and time it."""
    if engine.has_unfinished():
        raise RuntimeError("the engine has unfinished requests; time batches on an idle engine only")
    t0 = time.perf_counter()
    reqs = [engine.add_request(None, params, prompt_token_ids=p) for p in prompts]
    seqs = [s for r in reqs for s in r.seqs]
    prefill_steps = 0
    while engine.has_unfinished() and not all(s.output_token_ids for s in seqs):
        engine.step()
        prefill_steps += 1
    t1 = time.perf_counter()
    steps: list[float] = []
    while engine.has_unfinished():
        a = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - a)
    t2 = time.perf_counter()
    return BatchTiming(
        batch=len(seqs),
        prompt_tokens=sum(len(p) for p in prompts),
        generated_tokens=sum(len(s.output_token_ids) for s in seqs),
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        prefill_steps=prefill_steps,
        decode_step_s=tuple(steps),
    )


def blocks_per_sequence(prompt_tokens: int, new_tokens: int, block_size: int) -> int:
    # The last sampled token is never fed back, so it takes no KV slot.
    return -(-(prompt_tokens + new_tokens - 1) // block_size)


def why_cannot_run(engine: Any, batch: int, prompt_tokens: int, new_tokens: int) -> str | None:
    """None when the batch runs without preemption; else the reason, phrased for a table cell."""
    total = prompt_tokens + new_tokens
    if total > engine.max_model_len:
        return f"{prompt_tokens} + {new_tokens} tokens > max-model-len {engine.max_model_len}"
    stats = engine.stats()
    if batch > stats.max_num_seqs:
        return f"batch {batch} > max-num-seqs {stats.max_num_seqs}"
    need = batch * blocks_per_sequence(prompt_tokens, new_tokens, stats.block_size)
    if need > stats.kv_blocks:
        # Running it anyway would preempt and recompute, timing the scheduler's fallback instead of the model.
        return f"KV cache: needs {need} blocks, has {stats.kv_blocks}"
    return None


def build_llm(fields: dict[str, Any]) -> tuple[Any, str | None]:
    """(LLM, None), or (None, why) when the engine cannot start with these settings (e.g. an unwired scheme)."""
    from pydantic import ValidationError

    from glowplug.engine.llm import LLM
    from glowplug.engine.startup import StartupFailed

    try:
        return LLM(config=EngineConfig.from_flat(**fields)), None
    except StartupFailed as exc:
        return None, str(exc)
    except ValidationError as exc:
        return None, "invalid setting: " + "; ".join(e["msg"] for e in exc.errors())
    except (ValueError, NotImplementedError) as exc:
        return None, f"{type(exc).__name__}: {exc}"



def model_position_limit(model: str, cache_dir: Path | None = None) -> int:
    """The longest max-model-len the model allows (converting the embedded default into the cache if needed)."""
    from glowplug.engine.kv_sizing import model_len_limit
    from glowplug.engine.models.arch import load_arch
    from glowplug.engine.models.store import resolve_model

    return model_len_limit(load_arch(resolve_model(model, cache_dir, quiet=True)))
