"""Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the official file as users download it (`glowplug models fetch
qwen2.5-coder-1.5b`; skipped, naming that command, until it is fetched): de-quantized in fp32 its greedy tokens are
transformers' reading the same file. (Its default start, `--quantization auto`, serves in
tests/lifecycle/test_qwen_server.py.)"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from glowplug.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
PROMPT = 'def quicksort(items: list[int]) -> list[int]:\n    """Sort the items in ascending order."""\n'
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# A 1.5B model in fp32 is 7 GB: one engine at a time, a small KV pool, no compile (its cost is not this test's).
SMALL: dict[str, object] = dict(compile="off", max_model_len=512, num_gpu_blocks_override=64, max_num_seqs=2)


@pytest.mark.timeout(1800)  # two fp32 loads of a 1.5B model and 64 decode steps on 2 cores
def test_none_fp32_greedy_tokens_equal_transformers(qwen_gguf: Path) -> None:
    """32 greedy tokens at --quantization none --dtype float32 equal transformers' generate on the same GGUF
    (fp32). Ours runs first and is freed before transformers loads, so the test peaks at one fp32 copy."""
    from transformers import AutoModelForCausalLM

    from glowplug.engine.llm import LLM

    llm = LLM(str(qwen_gguf), dtype="float32", quantization="none", **SMALL)
    ids = llm.tokenizer(PROMPT)["input_ids"]
    got = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    del llm
    gc.collect()
    hf = AutoModelForCausalLM.from_pretrained(
        str(qwen_gguf.parent), gguf_file=qwen_gguf.name, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert got == out[0, len(ids) :].tolist()
