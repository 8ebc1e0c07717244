"""The sampler's draws (engine/sampler.py): a fixed number of kernel launches per step whatever the batch, tokens
distributed as p, seeded rows independent of their batch, and the vectorised penalties against a per-row loop."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glowplug.engine.sampler import _mix64, apply_penalties, draw, key_for_seed, row_uniform, sample
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.sequence import Sequence

VOCAB = 512


def _seq(params: SamplingParams, key: int | None, outputs: list[int] | None = None, seq_id: int = 0) -> Sequence:
    return cast(
        Sequence,
        SimpleNamespace(
            seq_id=seq_id,
            params=params,
            sample_key=key,
            prompt_token_ids=[1, 7, 42, 7],
            output_token_ids=list(outputs or []),
        ),
    )


class _CountOps(TorchDispatchMode):
    """Every operator call that reaches the dispatcher (each is at least one kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01)
PENALISED = SamplingParams(
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    min_p=0.01,
    repetition_penalty=1.2,
    frequency_penalty=0.4,
    presence_penalty=0.3,
    logprobs=2,
)

# Each mix gives row i its parameters and whether it is seeded. Row 0 alone already uses every feature its mix uses
# (a filter, a penalty, logprobs), so that 1, 4 and 32 rows differ in their number of rows only.
MIXES: dict[str, Callable[[int], tuple[SamplingParams, bool]]] = {
    "greedy": lambda i: (GREEDY, False),
    "sampled": lambda i: (SAMPLED, False),
    "mixed": lambda i: (SAMPLED if i % 2 == 0 else GREEDY, False),
    "seeded": lambda i: (SAMPLED, i % 3 == 0),
    "penalties": lambda i: (PENALISED if i % 2 == 0 else SAMPLED.model_copy(update={"logprobs": 1}), i % 4 == 0),
}


def _batch(mix: str, rows: int) -> list[Sequence]:
    seqs = []
    for i in range(rows):
        params, seeded = MIXES[mix](i)
        key = key_for_seed(1234 + i) if seeded else key_for_seed(10**9 + 7 * i)
        seqs.append(_seq(params, key, [(5 * i + j) % VOCAB for j in range(i % 5 + 1)], i))
    return seqs


def _launches(mix: str, rows: int) -> list[str]:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows))
    with _CountOps() as count:
        sample(logits, _batch(mix, rows))
    return count.calls


def test_launches_per_step_do_not_depend_on_rows_or_their_mix() -> None:
    counts = {mix: {rows: _launches(mix, rows) for rows in (1, 4, 32)} for mix in MIXES}
    for mix, by_rows in counts.items():
        assert by_rows[1] == by_rows[4] == by_rows[32], (mix, {r: len(c) for r, c in by_rows.items()})
    # Greedy, sampled and seeded rows share one path: a batch's mix does not change what runs, only which features
    # appear in it at all (penalties, logprobs add their own fixed number).
    assert counts["mixed"][32] == counts["sampled"][32] == counts["seeded"][32]
    # A handful for greedy rows; every filter, penalty and logprob at once stays under a hundred operator calls
    # (views included), where the per-row draw made 32 rows cost 32 launches for the noise alone.
    assert len(counts["greedy"][32]) < len(counts["sampled"][32]) < len(counts["penalties"][32]) < 100


# Chi-square critical values at p = 0.001 for the degrees of freedom used below (a fixed seed makes the statistic
# deterministic: this is a check that the draw is the distribution, not a flaky test).
CHI2_999 = {5: 20.515, 7: 24.322}


def _chi2(observed: torch.Tensor, p: torch.Tensor, n: int) -> float:
    expected = p.double() * n
    keep = expected > 0
    return float(((observed.double()[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_independent_rows_sample_p() -> None:
    """20000 unseeded rows (distinct keys) of one distribution, drawn in one call: the token frequencies fit p."""
    p = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.05, 0.01])
    n = 20000
    logits = p.log().expand(n, -1).contiguous()
    seqs = [_seq(SamplingParams(temperature=1.0), key_for_seed(i)) for i in range(n)]
    tokens = torch.tensor([r.token_id for r in sample(logits, seqs)])
    assert _chi2(torch.bincount(tokens, minlength=8), p, n) < CHI2_999[7]


def test_one_sequence_stream_samples_the_filtered_distribution() -> None:
    """One key's successive draws (a seeded sequence's stream), through temperature and top-k: frequencies fit the
    softmax of logits / T over the k likeliest tokens, and the others never appear."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.4, 0.3, -0.5, -1.0, 0.45, 1.2])
    t, k, n = 0.7, 6, 20000
    kept = logits.topk(k).indices
    p = torch.zeros(10)
    p[kept] = (logits[kept] / t).softmax(-1)  # the oracle: renormalised over the kept tokens
    scaled = (logits / t).masked_fill(p == 0, float("-inf"))
    key = key_for_seed(42)
    uniforms = torch.tensor([row_uniform(key, c) for c in range(n)], dtype=torch.float64)
    tokens = draw(scaled.expand(n, -1).contiguous(), uniforms)
    counts = torch.bincount(tokens, minlength=10)
    assert int(counts[p == 0].sum()) == 0
    assert _chi2(counts, p, n) < CHI2_999[k - 1]


def test_uniforms_are_splitmix64() -> None:
    """The stream is splitmix64: its published first outputs for state 0, as the top 53 bits of the uniforms."""
    outputs = (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F)
    assert [_mix64((i + 1) * 0x9E3779B97F4A7C15 % 2**64) for i in range(3)] == list(outputs)
    assert [row_uniform(0, c) for c in range(3)] == [((z >> 11) + 0.5) / 2**53 for z in outputs]
    assert all(0.0 < row_uniform(key_for_seed(s), c) < 1.0 for s in range(50) for c in range(50))


def test_a_zero_probability_token_is_never_drawn() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]]).expand(4, -1)
    edges = torch.tensor([2.0**-54, 0.5, 0.5 + 2.0**-53, 1 - 2.0**-53], dtype=torch.float64)
    assert draw(logits.contiguous(), edges).tolist() == [0, 0, 2, 2]


def _run(rows: int, at: int, steps: int = 24, device: str = "cpu") -> list[int]:
    """`steps` tokens of one seeded sequence at row `at` of a batch of `rows`, its neighbours of every kind."""
    me = _seq(SamplingParams(temperature=0.9, top_p=0.95, seed=7), key_for_seed(7))
    others = [
        _seq(MIXES["penalties" if j % 3 else "mixed"](j)[0], key_for_seed(99 + j), [3, 4], j + 1)
        for j in range(rows - 1)
    ]
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        mine = torch.randn(VOCAB, generator=gen) * 2  # the row this sequence's model output would be
        logits = torch.randn(rows, VOCAB)  # the neighbours' rows: anything, different every run
        logits[at] = mine
        batch = others[:at] + [me] + others[at:]
        me.output_token_ids.append(sample(logits.to(device), batch)[at].token_id)
    return me.output_token_ids


def test_a_seeded_row_samples_the_same_tokens_in_any_batch_and_position() -> None:
    alone = _run(1, 0)
    assert len(set(alone)) > 10  # sampling, not a greedy pick
    for at in (0, 3, 7):
        assert _run(8, at) == alone, at


@pytest.mark.cuda
def test_a_seeded_row_on_cuda_samples_as_on_the_cpu() -> None:
    """The uniforms come from the host, so a seeded row draws the same tokens on a GPU, alone or in a batch (the
    float32 softmax may differ in its last bits between devices: a token could differ only where U falls that close
    to a boundary of the cumulative sum)."""
    alone = _run(1, 0)
    assert _run(1, 0, device="cuda") == alone
    for at in (0, 5):
        assert _run(8, at, device="cuda") == alone, at
    counts = {rows: _cuda_launches(rows) for rows in (1, 4, 32)}
    assert counts[1] == counts[4] == counts[32], {r: len(c) for r, c in counts.items()}


def _cuda_launches(rows: int) -> list[str]:
    logits = torch.randn(rows, VOCAB, device="cuda")
    batch = _batch("penalties", rows)
    with _CountOps() as count:
        sample(logits, batch)
    return count.calls


def test_unseeded_rows_differ() -> None:
    """Two sequences with different keys on the same logits draw different tokens (not one shared stream)."""
    logits = torch.zeros(2, 64)
    seqs = [_seq(SamplingParams(temperature=1.0), key_for_seed(s)) for s in (11, 12)]
    draws = []
    for step in range(16):
        for s in seqs:
            s.output_token_ids[:] = [0] * step
        draws.append(tuple(r.token_id for r in sample(logits, seqs)))
    assert sum(a != b for a, b in draws) > 12


def test_a_sampled_row_without_a_key_is_refused() -> None:
    with pytest.raises(ValueError, match="no sample_key"):
        sample(torch.zeros(1, 8), [_seq(SamplingParams(temperature=1.0), None)])


def _penalties_one_row(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The oracle: one row's penalties in plain per-row torch (transformers' repetition penalty, OpenAI's
    presence/frequency)."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)))
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=logits.shape[-1]).float()
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def test_vectorised_penalties_match_a_per_row_loop() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 48, generator=g) * 3
    logits[2, 5] = float("-inf")
    kinds = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=-0.7, repetition_penalty=0.8),
        SamplingParams(),
        SamplingParams(frequency_penalty=1.1, presence_penalty=0.2, repetition_penalty=2.0),
        SamplingParams(presence_penalty=0.4),
    ]
    outputs = [[5, 5, 9], [1, 1, 1, 47], [5, 0], [2], [], [7, 8, 7]]
    seqs = [_seq(k, 0, o) for k, o in zip(kinds, outputs)]
    want = logits.clone()
    for i, s in enumerate(seqs):
        _penalties_one_row(want[i], s)
    rows = [i for i in range(6) if i != 3]
    got = apply_penalties(logits.clone(), rows, [seqs[i] for i in rows])
    assert torch.equal(got, want)
    assert not math.isfinite(float(got[2, 5]))
