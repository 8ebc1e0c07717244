"""What the engine tells a benchmark about its decode step: each layer's kernel and weight bytes
(`LLMEngine.layer_kernels`), their total (`LLM.weight_traffic`), and the model/sampler clock (`step_times`)."""

from __future__ import annotations

from typing import Any

import torch

from glowplug.engine.layer_kernels import DENSE, HEAD, NORM


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_an_unquantized_step_reads_every_weight_but_the_embedding(tiny_dir: Any, make_llm: Any) -> None:
    """The oracle is the model's own parameter list: a decode step reads each of them once, except the embedding
    table (a lookup reads a few rows), which a tied head reads again as the LM head."""
    llm = make_llm(tiny_dir("llama"), compile="off", quantization="none")
    model = llm.engine.model
    embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).weight
    expected = sum(_bytes(p) for p in model.parameters()) - _bytes(embedding)
    if llm.startup.arch.tie_word_embeddings:
        expected += _bytes(embedding)
    kernels = llm.engine.layer_kernels(1)
    assert {k.kernel for k in kernels} <= {DENSE, HEAD, NORM}
    assert sum(k.weight_bytes for k in kernels) == expected
    traffic = llm.weight_traffic()
    assert (traffic.bytes_per_step, traffic.from_start) == (expected, False)  # eager: no native_kernels count


def test_step_times_grow_by_the_model_call_and_the_sampler(tiny_dir: Any, make_llm: Any) -> None:
    llm = make_llm(tiny_dir("llama"), compile="off")
    before = llm.engine.step_times()
    out = llm.generate(["hello there"], None)
    after = llm.engine.step_times()
    assert out[0].outputs[0].token_ids
    assert after.model_ns > before.model_ns and after.sample_ns > before.sample_ns
