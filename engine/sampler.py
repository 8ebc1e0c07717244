"""Turn a batch of next-token logits into tokens, each row with its own sampling parameters, in batched tensor ops.

Greedy rows take one argmax over the batch. Sampled rows are scaled by their temperatures and filtered by top-k,
top-p and min-p as batch operations (per-row thresholds as tensors), then drawn by inverse transform: the first token
whose cumulative probability reaches U * total, with one uniform U per row. Penalties are applied to all their rows at
once from (row, token) pairs gathered on the host. So a step launches the same kernels however many rows it has and
however they mix greedy, sampled and seeded rows: the count depends only on which features appear in the batch at all
(any sampled row, any top-k / top-p / min-p, any penalty, any logprobs), never on how many rows use them. All results
reach the host in one transfer per step.

Where the randomness comes from: each sequence holds a 64-bit key (`RunnerSeq.sample_key`: from the request's seed,
or drawn from the engine's generator when it has none, see `key_for_seed`), and its draw for its t-th sampled token
is a counter-based hash of (key, t), computed on the host (`row_uniform`, splitmix64). A uniform per row costs the
host a few integer operations, against the one-launch-per-row torch.Generator draw of the noise this replaced, and it
is a pure function of the sequence: a seeded request samples the same tokens whatever else shares its batch, wherever
its row sits, on any device, and across runs (t counts the sequence's own tokens, so a preempted and recomputed
sequence continues its stream where it stopped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from glowplug.kernels.native import first_max_indices

from .outputs import TokenLogprobs
from .sequence import RunnerSeq

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment: 2**64 / golden ratio, odd


def _mix64(z: int) -> int:
    """splitmix64's output function (Stafford's Mix13): a bijection of 64-bit integers whose every output bit depends
    on every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def key_for_seed(seed: int) -> int:
    """A sequence's 64-bit sampling key from its seed (the request's `seed` + its completion index, or a number drawn
    from the engine's generator): mixed, so that neighbouring seeds (the n completions of one request) start
    unrelated streams."""
    return _mix64(seed & _MASK64)


def row_uniform(key: int, counter: int) -> float:
    """U in (0, 1) for draw number `counter` of the sequence with `key`: splitmix64 (a counter-based generator: the
    state after n steps is key + n * gamma) at counter + 1, its top 53 bits centred in their interval, so U is never
    0 or 1."""
    z = _mix64((key + (counter + 1) * _GOLDEN_GAMMA) & _MASK64)
    return ((z >> 11) + 0.5) * 2.0**-53


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


def apply_penalties(logits: torch.Tensor, rows: list[int], seqs: list[RunnerSeq]) -> torch.Tensor:
    """Row rows[j]'s repetition (CTRL-style, over prompt and output, as transformers) and presence/frequency
    (OpenAI-style, over output) penalties from seqs[j], in place on logits [B, V], every row at once: the host
    gathers each penalty's (row, token) pairs (O(the rows' tokens) Python work, as before), and the device applies
    them in a fixed number of launches whatever the number of rows."""
    dev = logits.device
    rep_rows: list[int] = []
    rep_ids: list[int] = []
    rep_factor = [1.0] * logits.shape[0]
    out_rows: list[int] = []
    out_ids: list[int] = []
    freq = [0.0] * logits.shape[0]
    pres = [0.0] * logits.shape[0]
    for row, seq in zip(rows, seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            ids = set(seq.prompt_token_ids)
            ids.update(seq.output_token_ids)
            rep_rows += [row] * len(ids)
            rep_ids += ids
            rep_factor[row] = p.repetition_penalty
        if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
            out_rows += [row] * len(seq.output_token_ids)
            out_ids += seq.output_token_ids
            freq[row], pres[row] = p.frequency_penalty, p.presence_penalty
    if rep_rows:
        at = (torch.tensor(rep_rows, device=dev), torch.tensor(rep_ids, device=dev))
        factor = torch.tensor(rep_factor, dtype=logits.dtype, device=dev)[at[0]]
        vals = logits[at]
        logits[at] = torch.where(vals > 0, vals / factor, vals * factor)
    if out_rows:
        at = (torch.tensor(out_rows, device=dev), torch.tensor(out_ids, device=dev))
        counts = torch.zeros_like(logits).index_put_(
            at, torch.ones((), dtype=logits.dtype, device=dev), accumulate=True
        )
        # Rows without these penalties have 0 for both and no counts: logits - 0 leaves them as they were.
        coef = torch.tensor([freq, pres], dtype=logits.dtype, device=dev)
        logits -= coef[0, :, None] * counts + coef[1, :, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[int], seqs: list[RunnerSeq]) -> torch.Tensor:
    """Add row rows[j]'s `logit_bias` (from seqs[j].params: token id -> value) to logits [B, V], in place, every row
    at once: the host lists the (row, token, value) triples and one index_put_ adds them. A bias of -100 bans its
    token and +100 forces it, as OpenAI's; a token the grammar excluded (-inf) stays excluded."""
    at_rows: list[int] = []
    at_ids: list[int] = []
    values: list[float] = []
    for row, seq in zip(rows, seqs):
        bias = seq.params.logit_bias or {}
        at_rows += [row] * len(bias)
        at_ids += bias.keys()
        values += bias.values()
    if at_rows:
        dev = logits.device
        at = (torch.tensor(at_rows, device=dev), torch.tensor(at_ids, device=dev))
        logits.index_put_(at, torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


# -inf as the integer lanes of each float type (its bit pattern): `banned * pattern` viewed as the float is 0.0 for
# an allowed token and -inf for a banned one, so the mask is one add, without a branch per token.
_NEG_INF_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float32: (torch.int32, -8388608),  # 0xFF800000
    torch.bfloat16: (torch.int16, -128),  # 0xFF80
    torch.float16: (torch.int16, -1024),  # 0xFC00
}


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """Exclude (set to -inf) the tokens a grammar forbids, in the rows `rows` of `logits` [B, V] only: bitmask [R, W]
    int32, row j the mask of logits row rows[j], bit t % 32 of word t // 32 set when token t is allowed (the layout
    xgrammar and llguidance fill); tokens past its 32 * W (logits wider than the tokenizer) are excluded too.

    All constrained rows are unpacked at once (numpy, of the inverted words: a set bit is a banned token) into a
    bias of 0 or -inf, added to each constrained row in place: a masked_fill branches on every token and took
    several times as long on a real mask. On the CPU with float32 logits the add is numpy's, on one thread, so it
    does not wait for torch's intra-op pool on a busy machine. Rows not in `rows` are not touched, and a step
    without constrained rows pays nothing. Returns `logits`. (A +inf or NaN logit of a banned token becomes NaN,
    not -inf; logits are finite.)"""
    if not rows:
        return logits
    count, vocab = len(rows), logits.shape[-1]
    banned = np.unpackbits(
        np.invert(bitmask[:count]).view(np.uint8), axis=-1, count=min(vocab, 32 * bitmask.shape[-1]), bitorder="little"
    )
    if banned.shape[-1] < vocab:  # logits wider than the mask: the tokens past it are banned
        banned = np.pad(banned, ((0, 0), (0, vocab - banned.shape[-1])), constant_values=1)
    lanes = _NEG_INF_BITS.get(logits.dtype)
    if lanes is None:  # float64: no bias trick needed at this rarity
        neg = torch.from_numpy(banned).to(device=logits.device, dtype=torch.bool)
        for j, row in enumerate(rows):
            logits[row].masked_fill_(neg[j], float("-inf"))
        return logits
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        bias = np.multiply(banned, np.int32(lanes[1]), dtype=np.int32).view(np.float32)
        values = logits.numpy()
        for j, row in enumerate(rows):
            np.add(values[row], bias[j], out=values[row])
        return logits
    bias_t = torch.from_numpy(banned).to(logits.device).to(lanes[0]).mul_(lanes[1]).view(logits.dtype)
    if rows == list(range(count)):
        logits[:count].add_(bias_t)
    else:
        for j, row in enumerate(rows):
            logits[row].add_(bias_t[j])
    return logits


def draw(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` [R, V] (float32, -inf for excluded tokens), drawn from softmax(logits) by inverse
    transform with `uniforms` [R] (float64, in (0, 1)): the first token whose cumulative probability reaches U times
    the row's total. The cumulative sum runs in float64, so a token's chance is its float32 probability to about
    1e-16, and a token of probability 0 (a filtered one) can never be drawn: it adds nothing to the sum, so the
    first index reaching U * total (> 0) is never one of them."""
    probs = logits.softmax(dim=-1)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = uniforms[:, None] * cdf[:, -1:]
    # The clamp only matters for a row of NaN logits, whose sum is NaN: keep the index inside the vocabulary.
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=logits.shape[-1] - 1)


def _uniform(seq: RunnerSeq) -> float:
    if seq.sample_key is None:
        raise ValueError(f"sequence {seq.seq_id} samples (temperature {seq.params.temperature}) but has no sample_key")
    return row_uniform(seq.sample_key, len(seq.output_token_ids))


@dataclass(slots=True)  # one per row per step, read and freed on the engine's host path: no per-object __dict__
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None


class TokenMasks(NamedTuple):
    """Grammar masks of some rows of a step: bitmask row j (see apply_token_bitmask) belongs to logits row rows[j]."""

    bitmask: np.ndarray
    rows: list[int]


def _has_penalty(seq: RunnerSeq) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def sample(logits: torch.Tensor, seqs: list[RunnerSeq], masks: TokenMasks | None = None) -> list[SampleResult]:
    """logits: [len(seqs), vocab] in the model's dtype (float32 or bfloat16), one row per sequence that produces a
    token this step. Arithmetic on them runs in float32: the batch is widened when a row asks for logprobs or
    penalties, and the sampled rows are; greedy rows take their argmax from the logits as they are. A sampled row
    draws with its sequence's `sample_key` and its number of output tokens so far (see the module docstring).
    `masks`: the grammar masks of the constrained rows, applied (in place) before anything else looks at the logits;
    the other rows are not touched. Penalties and logit biases change the logits the tokens are chosen from, not
    the logprobs reported (those are the model's, after the grammar's mask), and only a batch with such a row pays
    for them (a float copy of its logits and one scatter)."""
    if masks is not None:
        apply_token_bitmask(logits, masks.bitmask, masks.rows)
    params = [s.params for s in seqs]
    want_lp = [p.logprobs for p in params]
    lp_rows = [i for i, n in enumerate(want_lp) if n is not None]
    penal = [i for i, s in enumerate(seqs) if _has_penalty(s)]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    raw = logits.float() if lp_rows or penal or biased else logits
    logprobs = torch.log_softmax(raw, dim=-1) if lp_rows else None
    if penal or biased:
        logits = raw.clone()
        if penal:
            apply_penalties(logits, penal, [seqs[i] for i in penal])
        if biased:
            apply_logit_bias(logits, biased, [seqs[i] for i in biased])
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
        uniforms = torch.tensor([_uniform(seqs[i]) for i in sampled], dtype=torch.float64, device=dev)
        tokens = tokens.index_copy(0, idx, draw(sub, uniforms))
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
                ids = host[base + i * kmax : base + i * kmax + want_lp[i]]  # type: ignore[operator]
                vals = host[base + n * kmax + i * kmax : base + n * kmax + i * kmax + want_lp[i]]  # type: ignore[operator]
                top = {int(t): float(v) for t, v in zip(ids, vals)}
            lp = TokenLogprobs(token_id=tok, logprob=float(chosen), top=top)
        results.append(SampleResult(tok, lp))
    return results
