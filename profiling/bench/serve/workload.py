"""The request set of a serving benchmark and when each request is sent.

Prompts come from a built-in synthetic set (deterministic pseudo-English cut to an exact token count with the model's
tokenizer, each with a unique opening so prefix caching cannot share them) or from a JSONL file. Output lengths are
fixed or uniform within ±range_ratio of the mean. Arrivals: Poisson (exponential gaps), bursts of `burst_size`
requests at Poisson-distributed burst times, or constant gaps; all seeded, so two runs send the same schedule.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .config import ServeBenchConfig


def corpus_words() -> tuple[str, ...]:
    """The words synthetic prompts are drawn from (package data: data/words.txt), in file order."""
    words = resources.files(__name__.rpartition(".")[0]).joinpath("data", "words.txt")
    return tuple(words.read_text(encoding="utf-8").split())


WORDS = corpus_words()


class DatasetError(ValueError):
    """A JSONL line that cannot be used; the message names the line and the fix."""


@dataclass(frozen=True)
class RequestSpec:
    """One request of the set: its prompt (text or chat messages), tokens to generate, extra body fields."""

    index: int
    prompt: str | None
    messages: list[dict[str, str]] | None
    output_len: int
    prompt_tokens: int  # as counted by the benchmark's tokenizer (the server reports its own in usage)
    extra: dict[str, Any] = field(default_factory=dict)


def _lengths(mean: int, count: int, dist: str, ratio: float, rng: random.Random) -> list[int]:
    if dist == "fixed" or ratio == 0.0:
        return [mean] * count
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(count)]


def synthetic_text(tokenizer: Any, index: int, tokens: int, rng: random.Random) -> str:
    """Text of exactly `tokens` tokens (as `tokenizer` counts them alone), opening with a unique marker."""
    words = [f"Request {index}:"]
    while True:
        words += rng.choices(WORDS, k=max(8, tokens))
        ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens:
            break
    text = tokenizer.decode(ids[:tokens], skip_special_tokens=True)
    # Decoding and re-encoding can merge tokens at the cut; trim until the count is exact (a few words at most).
    while len(tokenizer(text, add_special_tokens=False)["input_ids"]) > tokens and " " in text:
        text = text.rsplit(" ", 1)[0]
    return text


def synthetic_requests(cfg: ServeBenchConfig, tokenizer: Any, count: int, seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    ins = _lengths(cfg.input_len, count, cfg.len_distribution, cfg.range_ratio, rng)
    outs = _lengths(cfg.output_len, count, cfg.len_distribution, cfg.range_ratio, rng)
    specs = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        text = synthetic_text(tokenizer, i, n_in, rng)
        n_tokens = len(tokenizer(text)["input_ids"])
        if cfg.endpoint == "chat":
            specs.append(RequestSpec(i, None, [{"role": "user", "content": text}], n_out, n_tokens))
        else:
            specs.append(RequestSpec(i, text, None, n_out, n_tokens))
    return specs


def load_jsonl(cfg: ServeBenchConfig, path: Path, tokenizer: Any, count: int, seed: int = 0) -> list[RequestSpec]:
    """`count` requests from a JSONL file (cycled when it has fewer lines).

    Each line: {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}, and optionally
    "output_len" (else drawn from --output-len / --len-distribution).
    """
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{n}: not JSON ({exc}); write one JSON object per line") from None
        if not isinstance(row, dict) or not ({"prompt", "messages"} & row.keys()):
            raise DatasetError(f'{path}:{n}: needs a "prompt" string or a "messages" list')
        out = row.get("output_len")
        if out is not None and (not isinstance(out, int) or out < 1):
            raise DatasetError(f'{path}:{n}: "output_len" must be a positive integer (got {out!r})')
        rows.append(row)
    if not rows:
        raise DatasetError(f"{path}: no requests in the file")
    rng = random.Random(seed)
    outs = _lengths(cfg.output_len, count, cfg.len_distribution, cfg.range_ratio, rng)
    specs = []
    for i in range(count):
        row = rows[i % len(rows)]
        n_out = int(row.get("output_len") or outs[i])
        if "messages" in row:
            messages = row["messages"]
            text = " ".join(str(m.get("content", "")) for m in messages)
            specs.append(RequestSpec(i, None, messages, n_out, len(tokenizer(text)["input_ids"])))
        else:
            prompt = str(row["prompt"])
            if cfg.endpoint == "chat":
                specs.append(
                    RequestSpec(
                        i, None, [{"role": "user", "content": prompt}], n_out, len(tokenizer(prompt)["input_ids"])
                    )
                )
            else:
                specs.append(RequestSpec(i, prompt, None, n_out, len(tokenizer(prompt)["input_ids"])))
    return specs


def build_requests(cfg: ServeBenchConfig, tokenizer: Any, count: int, seed: int = 0) -> list[RequestSpec]:
    if cfg.dataset is not None:
        return load_jsonl(cfg, cfg.dataset, tokenizer, count, seed)
    return synthetic_requests(cfg, tokenizer, count, seed)


def arrival_times(count: int, rate: float, arrival: str, burst_size: int = 1, seed: int = 0) -> list[float]:
    """Send offsets in seconds from the start (non-decreasing; the first request goes at 0)."""
    if count <= 0:
        return []
    rng = random.Random(seed)
    if arrival == "constant":
        return [i / rate for i in range(count)]
    if arrival == "poisson":
        t, out = 0.0, [0.0]
        for _ in range(count - 1):
            t += rng.expovariate(rate)
            out.append(t)
        return out
    if arrival == "burst":
        # The same mean rate: bursts of `burst_size` arrive at rate / burst_size per second.
        t, out = 0.0, []
        while len(out) < count:
            out += [t] * min(burst_size, count - len(out))
            t += rng.expovariate(rate / burst_size)
        return out
    raise ValueError(f"unknown arrival process {arrival!r}; use poisson, burst or constant")


def length_summary(specs: Sequence[RequestSpec]) -> dict[str, float]:
    ins = [s.prompt_tokens for s in specs]
    outs = [s.output_len for s in specs]
    return {
        "requests": len(specs),
        "prompt_tokens_mean": sum(ins) / len(ins),
        "prompt_tokens_min": min(ins),
        "prompt_tokens_max": max(ins),
        "output_tokens_mean": sum(outs) / len(outs),
        "output_tokens_min": min(outs),
        "output_tokens_max": max(outs),
    }
