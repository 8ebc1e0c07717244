"""Batch invariance, under the default configuration: a request's greedy tokens are the same alone, in a batch of 8,
and at another row of the batch, for 64 tokens. The quantized layers compute on the GGUF's stored blocks with each
activation row quantized on its own (kernels/native/gguf.cpp), so no row's arithmetic depends on the others; the
oracle is the engine's own one-request-at-a-time run."""

from __future__ import annotations

from pathlib import Path

import pytest

from glowplug.engine.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "The three primary colors are",
    "In a paged KV cache, each block",
    "Once upon a time",
    "1, 2, 3, 4,",
    "The largest planet in our solar system is",
]
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def _tokens(outs: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [list(o.outputs[0].token_ids) for o in outs]


def _check(llm) -> None:  # type: ignore[no-untyped-def]
    batched = _tokens(llm.generate(PROMPTS, GREEDY_64))
    alone = [_tokens(llm.generate([p], GREEDY_64))[0] for p in PROMPTS]
    reversed_rows = _tokens(llm.generate(PROMPTS[::-1], GREEDY_64))[::-1]
    differ = [p for p, a, b in zip(PROMPTS, batched, alone) if a != b]
    assert not differ, f"batched differs from alone for {len(differ)} of 8: {differ}"
    assert reversed_rows == alone
    assert all(len(t) == 64 for t in batched)


def test_tiny_gguf_in_place_is_batch_invariant(tiny_dir, tmp_path: Path, make_llm) -> None:
    """Every projection and the embedding stored as Q4_0 or Q8_0 (a float layer would run oneDNN's GEMM in the
    prompt, whose arithmetic depends on the number of rows: the invariance covers the layers run in place)."""
    import gguf
    from test_quant_auto import MIXED, write_gguf

    quantized = {
        name: gguf.GGMLQuantizationType.Q8_0 if kind == gguf.GGMLQuantizationType.F16 else kind
        for name, kind in MIXED.items()
    }
    path = write_gguf(tiny_dir("llama"), tmp_path / "tiny-quantized.gguf", quantized)
    _check(make_llm(path, max_num_seqs=8))


@pytest.mark.slow
def test_default_model_is_batch_invariant(make_llm) -> None:
    _check(make_llm("smollm2", max_num_seqs=8))
