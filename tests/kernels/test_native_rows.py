"""The native greedy-token op (argmax_rows) against its oracle, torch's max(dim=-1).indices."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
import torch

from glowplug.engine.sampler import sample
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.sequence import Sequence
from glowplug.kernels.native import first_max_indices


@pytest.fixture(scope="module")
def native(native_build) -> None:  # type: ignore[no-untyped-def]
    build = native_build
    if not build.available:
        pytest.skip(f"native kernels unavailable here: {build.reason}")


# widths below one vector, one vector, a vector and a tail, and SmolLM2's vocabulary
@pytest.mark.parametrize("n", [1, 5, 16, 17, 33, 1000, 49152])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_matches_torch(native: None, n: int, rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * 100 + rows)
    cases = {
        "random": torch.randn(rows, n, generator=g),
        # ties everywhere: the first maximum's index, as torch gives it
        "ties": torch.randint(0, 4, (rows, n), generator=g).float(),
        "all -inf": torch.full((rows, n), float("-inf")),
    }
    nan = torch.randn(rows, n, generator=g)
    nan[:, n // 2] = float("nan")  # torch propagates NaN: its index is the answer
    if n > 2:
        nan[:, -1] = float("nan")
    cases["nan"] = nan
    op = torch.ops.glowplug_native.argmax_rows
    for name, x in cases.items():
        x = x.to(dtype)
        assert torch.equal(op(x), x.max(dim=-1).indices), name
        # bf16 logits widen exactly: the token is the one their fp32 copy gives
        assert torch.equal(op(x), x.float().max(dim=-1).indices), name


def test_argmax_rows_rejects_bad_input(native: None) -> None:
    with pytest.raises(RuntimeError, match="contiguous float32 or bfloat16"):
        torch.ops.glowplug_native.argmax_rows(torch.zeros(2, 8, dtype=torch.float16))
    # the sampler's entry point serves what the op does not (other dtypes, strided rows) with torch
    x = torch.randn(4, 40, dtype=torch.float64)
    assert torch.equal(first_max_indices(x), x.max(dim=-1).indices)
    y = torch.randn(40, 4).t()
    assert torch.equal(first_max_indices(y), y.max(dim=-1).indices)


def test_greedy_sampling_takes_the_native_tokens(native: None) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 49152, generator=g)
    # greedy rows read nothing of a sequence but its sampling parameters
    seqs = [cast(Sequence, SimpleNamespace(params=SamplingParams(temperature=0.0))) for _ in range(8)]
    got = [r.token_id for r in sample(logits, seqs)]
    assert got == logits.max(dim=-1).indices.tolist()


def test_bf16_logits_sample_as_their_fp32_copy(native: None) -> None:
    """The compiled step returns logits in the model's dtype; every kind of row (greedy, logprobs, penalties,
    seeded temperature sampling with top-k/top-p) must come out as it does from the same logits widened to fp32."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 49152, generator=g) * 4).bfloat16()
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, top_k=50, seed=11),
        SamplingParams(temperature=1.1, top_p=0.9, logprobs=2, seed=12),
        SamplingParams(temperature=0.0),
    ]

    def seqs() -> list[Sequence]:
        return [
            cast(
                Sequence,
                SimpleNamespace(params=p, prompt_token_ids=[1, 7, 42], output_token_ids=[42, 9, 9], sample_key=100 + i),
            )
            for i, p in enumerate(kinds)
        ]

    got, want = sample(logits, seqs()), sample(logits.float(), seqs())
    assert [r.token_id for r in got] == [r.token_id for r in want]
    assert [r.logprobs for r in got] == [r.logprobs for r in want]
    assert got[1].logprobs is not None and len(got[1].logprobs.top) == 3
