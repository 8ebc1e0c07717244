"""Turn a batch of next-token logits into tokens, each row with its own sampling parameters, in batched tensor ops.

Greedy rows take one argmax over the batch. Sampled rows are scaled by their temperatures and filtered by top-k,
top-p and min-p as batch operations (per-row thresholds as tensors), then drawn by the exponential race
argmax(p / E) with E ~ Exp(1): equivalent to drawing from p, and the noise for each row comes from its sequence's own
torch.Generator, so a seeded request samples the same tokens whatever else shares its batch. All results reach the
host in one transfer per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.native import first_max_indices
from .sequence import Sequence, TokenLogprobs


PerRow = list[float] | list[int] | tuple[float, ...] | tuple[int, ...]


def _per_row(v: PerRow | float, rows: int) -> list[float]:
    return [float(x) for x in v] if isinstance(v, (list, tuple)) else [float(v)] * rows


def apply_top_k(logits: torch.Tensor, k: PerRow | int) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value are kept too); the rest become -inf. k <= 0 or
    k >= vocab disables it for that row. `logits` is [V] or [B, V]; `k` an int or one per row. The decisions are
    made on the host-side parameters, so no device value is read back."""
    rows = logits.reshape(-1, logits.shape[-1])
    vocab = rows.shape[-1]
    ks = [int(x) for x in _per_row(k, rows.shape[0])]
    off = [x <= 0 or x >= vocab for x in ks]
    if all(off):
        return logits
    eff = [1 if o else x for x, o in zip(ks, off)]
    kk = torch.tensor(eff, device=rows.device)[:, None]
    kth = torch.topk(rows, max(eff), dim=-1).values.gather(-1, kk - 1)
    kth = kth.masked_fill(torch.tensor(off, device=rows.device)[:, None], float("-inf"))  # rows without top-k
    return rows.masked_fill(rows < kth, float("-inf")).reshape(logits.shape)


def apply_top_p(logits: torch.Tensor, p: PerRow | float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches p (always at least one)."""
    rows = logits.reshape(-1, logits.shape[-1])
    ps = _per_row(p, rows.shape[0])
    if all(x >= 1.0 for x in ps):
        return logits
    pp = torch.tensor(ps, device=rows.device)[:, None]
    sorted_logits, order = torch.sort(rows, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the mass strictly before it already reaches p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = (mass_before >= pp) & (pp < 1.0)
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return rows.masked_fill(drop, float("-inf")).reshape(logits.shape)


def apply_min_p(logits: torch.Tensor, min_p: PerRow | float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top token's probability."""
    rows = logits.reshape(-1, logits.shape[-1])
    ms = _per_row(min_p, rows.shape[0])
    if all(x <= 0.0 for x in ms):
        return logits
    mp = torch.tensor(ms, device=rows.device)[:, None]
    probs = rows.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * mp
    return rows.masked_fill(probs < threshold, float("-inf")).reshape(logits.shape)


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row's repetition (CTRL-style, over prompt and output, as transformers) and presence/frequency
    (OpenAI-style, over output) penalties, in place."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)), dtype=torch.long,
                           device=logits.device)  # fmt: skip
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


@dataclass(slots=True)  # one per row per step, read and freed on the engine's host path: no per-object __dict__
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None


def _has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
    """logits: [len(seqs), vocab] in the model's dtype (float32 or bfloat16), one row per sequence that produces a
    token this step. Arithmetic on them runs in float32: the batch is widened when a row asks for logprobs or
    penalties, and the sampled rows are; greedy rows take their argmax from the logits as they are."""
    params = [s.params for s in seqs]
    want_lp = [p.logprobs for p in params]
    lp_rows = [i for i, n in enumerate(want_lp) if n is not None]
    penal = [i for i, s in enumerate(seqs) if _has_penalty(s)]
    raw = logits.float() if lp_rows or penal else logits
    logprobs = torch.log_softmax(raw, dim=-1) if lp_rows else None
    if penal:
        logits = raw.clone()
        for i in penal:
            apply_penalties(logits[i], seqs[i])
    # Each row's first maximum (torch's max(dim).indices; argmax's CPU reduction took several times as long), on
    # the native op where it is loaded: kernels/native.first_max_indices says why.
    tokens = first_max_indices(logits)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        dev = logits.device
        idx = torch.tensor(sampled, dtype=torch.long, device=dev)
        sub = logits[idx].float() / torch.tensor([params[i].temperature for i in sampled], device=dev)[:, None]
        sub = apply_top_k(sub, [params[i].top_k for i in sampled])
        sub = apply_top_p(sub, [params[i].top_p for i in sampled])
        sub = apply_min_p(sub, [params[i].min_p for i in sampled])
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for row, i in enumerate(sampled):
            noise[row].exponential_(generator=seqs[i].generator)
        tokens = tokens.index_copy(0, idx, (probs / noise).max(dim=-1).indices)
    # Everything the host needs, in one transfer: tokens, their logprobs, and the top-n of the rows that ask.
    parts = [tokens.double()]
    kmax = max((n for n in want_lp if n), default=0)
    if logprobs is not None:
        parts.append(logprobs.gather(-1, tokens[:, None]).squeeze(-1).double())
        if kmax:
            top_vals, top_ids = torch.topk(logprobs, kmax, dim=-1)
            parts += [top_ids.double().flatten(), top_vals.double().flatten()]
    host = torch.cat(parts).tolist()
    n = len(seqs)
    toks = [int(t) for t in host[:n]]
    results = []
    for i, tok in enumerate(toks):
        lp = None
        if logprobs is not None and want_lp[i] is not None:
            chosen = host[n + i]
            top: dict[int, float] = {}
            if want_lp[i]:
                base = 2 * n
                ids = host[base + i * kmax : base + i * kmax + want_lp[i]]
                vals = host[base + n * kmax + i * kmax : base + n * kmax + i * kmax + want_lp[i]]
                top = {int(t): float(v) for t, v in zip(ids, vals)}
            lp = TokenLogprobs(token_id=tok, logprob=float(chosen), top=top)
        results.append(SampleResult(tok, lp))
    return results
