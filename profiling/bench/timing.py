"""Timing one batch through the engine, split into prefill and decode, plus the checks that decide whether a
batch shape can run at all (and the sentence that says why not).

`time_batch` is the one decode-timing loop of every benchmark (`bench decode`, `bench latency`, `bench throughput`,
`bench tune`, scripts/host_time_ab.py): prefill lasts until every sequence of the batch has its first token; decode
is everything after. Each decode step is timed on its own (for per-token percentiles), and so is its host time: the
step's wall time minus what the engine's `step_times()` (model call, sampler) grew by during it. The clock starts
before the requests are added, so `prefill_s + decode_s` is the batch's end-to-end latency.

The module imports only the standard library at load: scripts/host_time_ab.py loads this file by its path into
source trees that may predate it, and hands in its own clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class BookedTimes(Protocol):
    """What `LLMEngine.step_times()` returns: nanoseconds inside the model call and the sampler, summed so far."""

    @property
    def model_ns(self) -> int: ...

    @property
    def sample_ns(self) -> int: ...


@dataclass(frozen=True)
class BatchTiming:
    batch: int
    prompt_tokens: int  # summed over the batch
    generated_tokens: int  # summed over the batch
    prefill_s: float  # requests added -> every sequence has its first token
    decode_s: float  # from then until the last sequence finished
    prefill_steps: int  # engine steps the prefill took (> 1 when the step token budget chunks it)
    decode_step_s: tuple[float, ...]  # each decode step's wall time
    first_tokens: int = 0  # tokens the batch held when the prefill ended (>= batch: a step may add more than one)
    decode_host_s: tuple[float, ...] = ()  # each decode step's host time: wall - model call - sampler

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


def time_batch(
    engine: Any, prompts: list[list[int]], params: Any, booked: Callable[[], BookedTimes] | None = None
) -> BatchTiming:
    """Run `prompts` as one batch to completion on an idle engine and time it. `booked`: the clock of model and
    sampler time the host time leaves out (default: `engine.step_times`)."""
    if engine.has_unfinished():
        raise RuntimeError("the engine has unfinished requests; time batches on an idle engine only")
    clock = booked or engine.step_times
    t0 = time.perf_counter()
    reqs = [engine.add_request(None, params, prompt_token_ids=p) for p in prompts]
    seqs = [s for r in reqs for s in r.seqs]
    prefill_steps = 0
    while engine.has_unfinished() and not all(s.output_token_ids for s in seqs):
        engine.step()
        prefill_steps += 1
    t1 = time.perf_counter()
    first_tokens = sum(len(s.output_token_ids) for s in seqs)
    walls: list[float] = []
    hosts: list[float] = []
    while engine.has_unfinished():
        # Per step, not over the run: each step's own host time, whose median leaves out the odd step that a
        # garbage collection or another process interrupted.
        before = clock()
        a = time.perf_counter_ns()
        engine.step()
        wall = time.perf_counter_ns() - a
        after = clock()
        walls.append(wall / 1e9)
        hosts.append((wall - (after.model_ns - before.model_ns) - (after.sample_ns - before.sample_ns)) / 1e9)
    t2 = time.perf_counter()
    return BatchTiming(
        batch=len(seqs),
        prompt_tokens=sum(len(p) for p in prompts),
        generated_tokens=sum(len(s.output_token_ids) for s in seqs),
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        prefill_steps=prefill_steps,
        decode_step_s=tuple(walls),
        first_tokens=first_tokens,
        decode_host_s=tuple(hosts),
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

    from glowplug.engine.config import EngineConfig
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
