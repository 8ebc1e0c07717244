"""Turn a batch of next-token logits into tokens, each row with its own sampling parameters.

Each sequence owns its torch.Generator, so a seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence, TokenLogprobs


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (ties at the k-th value are kept too); the rest become -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p (always at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the mass strictly before it already reaches p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        # CTRL-style, as in transformers: over prompt and output tokens, shrink positive logits, grow negative.
        ids = torch.tensor(sorted(set(seq.all_token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        # OpenAI-style, over output tokens only.
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


@dataclass
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
    """logits: [len(seqs), vocab] float32, one row per sequence that produces a token this step."""
    results: list[SampleResult] = []
    raw_logprobs = None
    if any(s.params.logprobs is not None for s in seqs):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    for i, seq in enumerate(seqs):
        p = seq.params
        row = logits[i]
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            row = apply_penalties(row.clone(), seq)
        if p.greedy:
            token = int(torch.argmax(row))
        else:
            row = row / p.temperature
            row = apply_top_k(row, p.top_k)
            row = apply_top_p(row, p.top_p)
            row = apply_min_p(row, p.min_p)
            probs = row.softmax(dim=-1)
            token = int(torch.multinomial(probs, 1, generator=seq.generator))
        lp = None
        if raw_logprobs is not None and p.logprobs is not None:
            lrow = raw_logprobs[i]
            top = {}
            if p.logprobs:
                vals, ids = torch.topk(lrow, p.logprobs)
                top = {int(t): float(v) for t, v in zip(ids, vals)}
            lp = TokenLogprobs(token_id=token, logprob=float(lrow[token]), top=top)
        results.append(SampleResult(token, lp))
    return results
