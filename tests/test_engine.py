"""The generation core on tiny models: batching, preemption, prefix caching, chunked prefill, abort, streaming."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glowplug.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

PROMPTS = [
    "The scheduler",
    "Quantized weights read fewer bytes per token, so",
    "A",
    "Each key and value block holds sixteen tokens; full blocks are shared by prefix hash, and",
    "glowplug starts",
    "Numbers 0 1 2 3 4 5 6 7 8 9",
    "The quick brown fox jumps over the lazy dog while the compiler caches its graphs and the",
    "emoji 🚀",
]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _hf_greedy(model_dir: Path, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = m.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def test_batch_equals_alone_equals_transformers(tiny_dir, make_llm) -> None:
    d = tiny_dir("qwen2")
    llm = make_llm(d, num_gpu_blocks_override=256)
    batched = _tokens(llm.generate(PROMPTS, GREEDY))
    alone = [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]
    assert batched == alone
    assert all(len(t) == 12 for t in batched)
    for p, toks in zip(PROMPTS[:3], batched[:3]):
        assert toks == _hf_greedy(d, llm.tokenizer(p)["input_ids"], 12)


def test_preemption_keeps_outputs_identical(tiny_dir, make_llm) -> None:
    d = tiny_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = _tokens(make_llm(d, num_gpu_blocks_override=512, max_model_len=80).generate(PROMPTS, params))
    # 20 blocks of 4 tokens: enough for any one sequence, far too few for eight at once.
    tight = make_llm(d, num_gpu_blocks_override=20, cache={"block_size": 4}, max_model_len=80)
    got = _tokens(tight.generate(PROMPTS, params))
    assert tight.engine.stats().num_preemptions > 0
    assert got == roomy


def test_chunked_prefill_matches_whole_prefill(tiny_dir, make_llm) -> None:
    d = tiny_dir("llama")
    long_prompt = " ".join(PROMPTS[:5])
    whole = _tokens(make_llm(d).generate([long_prompt], GREEDY))
    llm = make_llm(d, scheduler={"max_num_batched_tokens": 16})
    chunked = _tokens(llm.generate([long_prompt, "A"], GREEDY))
    assert chunked[0] == whole[0]


def test_prefix_cache_hits_and_output_unchanged(tiny_dir, make_llm) -> None:
    d = tiny_dir("llama")
    llm = make_llm(d, cache={"block_size": 4})
    prefix = PROMPTS[3]
    first = llm.generate([prefix + " one"], GREEDY)[0]
    hits_before = llm.engine.stats().prefix_hits
    second = llm.generate([prefix + " one"], GREEDY)[0]
    n_prompt = len(second.prompt_token_ids)
    assert llm.engine.stats().prefix_hits - hits_before == (n_prompt - 1) // 4
    assert second.num_cached_tokens == (n_prompt - 1) // 4 * 4 > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    nocache = make_llm(d, cache={"block_size": 4, "enable_prefix_caching": False})
    assert nocache.generate([prefix + " one"], GREEDY)[0].outputs[0].token_ids == first.outputs[0].token_ids


def test_abort_frees_blocks_immediately(tiny_dir, make_llm) -> None:
    llm = make_llm(tiny_dir("llama"))
    eng = llm.engine
    req = eng.add_request(PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.stats().kv_used_blocks > 0
    assert eng.abort(req.request_id)
    assert eng.stats().kv_used_blocks == 0
    assert not eng.has_unfinished()


def test_streaming_deltas_rebuild_final_text(tiny_dir, make_llm) -> None:
    llm = make_llm(tiny_dir("llama"))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=20, n=2)
    pieces: dict[int, str] = {0: "", 1: ""}
    finals = {}
    for out in llm.stream(["The scheduler"], params):
        for c in out.outputs:
            pieces[c.index] += c.delta
            if out.finished:
                finals[c.index] = c.text
    assert finals and pieces == finals


def test_finish_reasons(tiny_dir, make_llm) -> None:
    llm = make_llm(tiny_dir("llama"))
    out = llm.generate(["The"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    first = out.token_ids[1]
    out2 = llm.generate(["The"], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(first,)))[0].outputs[0]
    assert out2.finish_reason == "stop" and out2.token_ids == out.token_ids[:2]


def test_same_seed_same_text_across_batches(tiny_dir, make_llm) -> None:
    llm = make_llm(tiny_dir("llama"))
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["glowplug starts"], p)[0].outputs[0].token_ids
    in_batch = llm.generate(PROMPTS[:3] + ["glowplug starts"], p)[-1].outputs[0].token_ids
    assert alone == in_batch
    other = llm.generate(["glowplug starts"], p.model_copy(update={"seed": 99}))[0].outputs[0].token_ids
    assert other != alone


def test_top_k_one_equals_greedy(tiny_dir, make_llm) -> None:
    llm = make_llm(tiny_dir("llama"))
    greedy = _tokens(llm.generate(PROMPTS[:4], GREEDY))
    topk = _tokens(llm.generate(PROMPTS[:4], SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True)))
    assert topk == greedy


def test_too_long_request_is_rejected_with_both_numbers(tiny_dir, make_llm) -> None:
    llm = make_llm(tiny_dir("llama"), max_model_len=64)
    with pytest.raises(
        ValueError, match=r"prompt tokens \(\d+\) \+ max_tokens \(60\) = \d+ exceeds max-model-len \(64\)"
    ):
        llm.generate([PROMPTS[3]], SamplingParams(max_tokens=60))


@pytest.mark.slow
def test_smollm2_batch_of_8_matches_transformers(smollm2_dir: Path, make_llm) -> None:
    # The oracle below is transformers in fp32, on the de-quantized weights (auto would run the Q4_1 blocks as int4).
    llm = make_llm("smollm2", dtype="float32", quantization="none")
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at",
        "The three primary colors are",
        "In a paged KV cache, each block",
        "Once upon a time",
        "1, 2, 3, 4,",
        "The largest planet in our solar system is",
    ]
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    batched = _tokens(llm.generate(prompts, p))
    alone = [_tokens(llm.generate([q], p))[0] for q in prompts]
    assert batched == alone
    from transformers import AutoModelForCausalLM

    from glowplug.engine.models.store import transformers_args

    where, kw = transformers_args(smollm2_dir)  # transformers reads the GGUF itself
    hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
    with torch.inference_mode():
        for q, toks in zip(prompts, batched):
            ids = llm.tokenizer(q)["input_ids"]
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert toks == ref[0, len(ids) :].tolist(), q
