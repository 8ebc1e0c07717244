"""One step, one owner: `Scheduler.schedule()` -> `ModelRunner.execute()` -> `Scheduler.update_from_output()`.

The oracle is the engine as it was before the step was split (its `_advance` set the computed tokens and decided
the stops itself): `engine_tokens_golden.json` holds what that engine generated for `scenario()` below, a run
that exercises every part of the step at once: chunked prompts, preemption and recompute (a KV cache far too
small for the batch), arrivals while others decode, sampled rows with seeds and n=2, penalties, logprobs, a stop
token, a stop string and an abort. The new step must give the same tokens, texts, finish reasons and logprobs.

`python tests/test_step_owner.py MODEL_DIR` rewrites the file from the engine checked out (the tiny llama of
`engine/models/tiny.py`, seed 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from glowplug.engine.sampling_params import SamplingParams

GOLDEN = Path(__file__).with_name("engine_tokens_golden.json")
PROMPTS = [
    "The scheduler",
    "Quantized weights read fewer bytes per token, so",
    "A",
    "Each key and value block holds sixteen tokens; full blocks are shared by prefix hash, and",
    "glowplug starts",
    "glowplug starts",  # the prompt of the stop-token request again: a prefix hit, and the stop string's text
]
ENGINE = {
    "compile": "off",
    "dtype": "float32",
    "num_gpu_blocks_override": 24,
    "cache": {"block_size": 4},
    "scheduler": {"max_num_batched_tokens": 16},
    "max_model_len": 96,
    "seed": 7,
}


def _params(stop_token: int, stop_text: str) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return [
        greedy,
        SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=18, ignore_eos=True, n=2),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3),
        SamplingParams(
            temperature=1.1,
            top_p=0.8,
            min_p=0.05,
            max_tokens=20,
            ignore_eos=True,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
        ),
        greedy.model_copy(update={"stop_token_ids": (stop_token,), "max_tokens": 30}),
        greedy.model_copy(update={"stop": (stop_text,), "max_tokens": 30}),
    ]


def scenario(llm: Any) -> dict[str, Any]:
    """Feed the requests one a step (so prompts arrive while others decode), abort one mid-way, run to the end."""
    eng = llm.engine
    probe = llm.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    tokens = probe.outputs[0].token_ids
    stop_token = tokens[6]
    stop_text = llm.tokenizer.decode(tokens[8:10]).strip() or llm.tokenizer.decode(tokens[8:10])
    pending = list(zip(PROMPTS, _params(stop_token, stop_text), strict=True))
    doomed = eng.add_request("to be aborted on the fourth step", SamplingParams(max_tokens=40, ignore_eos=True))
    ids: list[str] = []
    finals: dict[str, Any] = {}
    streamed: dict[str, str] = {}
    steps = 0
    while pending or eng.has_unfinished():
        if pending:
            prompt, params = pending.pop(0)
            ids.append(eng.add_request(prompt, params).request_id)
        for out in eng.step():
            for c in out.outputs:
                key = f"{out.request_id}/{c.index}"
                streamed[key] = streamed.get(key, "") + c.delta
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        if steps == 4:
            eng.abort(doomed.request_id)
    result: dict[str, Any] = {"stop_token": stop_token, "stop_text": stop_text, "requests": []}
    for rid in ids:
        out = finals[rid]
        comps = []
        for c in out.outputs:
            lps = (
                None
                if c.logprobs is None
                else [
                    [lp.token_id, round(lp.logprob, 4), sorted((int(t), round(v, 4)) for t, v in lp.top.items())]
                    for lp in c.logprobs
                ]
            )
            assert streamed[f"{rid}/{c.index}"] == c.text  # the deltas add up to the text
            comps.append(
                {
                    "index": c.index,
                    "token_ids": c.token_ids,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": lps,
                }
            )
        result["requests"].append({"num_cached_tokens": out.num_cached_tokens, "outputs": comps})
    result["preemptions"] = eng.stats().num_preemptions
    return result


def test_the_split_step_generates_what_the_old_engine_did(tiny_dir, make_llm) -> None:
    want = json.loads(GOLDEN.read_text())
    got = scenario(make_llm(tiny_dir("llama"), **ENGINE))
    assert got["preemptions"] > 0 and want["preemptions"] > 0  # the scenario does exercise recompute
    assert (got["stop_token"], got["stop_text"]) == (want["stop_token"], want["stop_text"])
    for g, w in zip(got["requests"], want["requests"], strict=True):
        for gc, wc in zip(g["outputs"], w["outputs"], strict=True):
            assert {k: gc[k] for k in ("index", "token_ids", "text", "finish_reason")} == {
                k: wc[k] for k in ("index", "token_ids", "text", "finish_reason")
            }
            if wc["logprobs"] is None:
                assert gc["logprobs"] is None
                continue
            for (gt, gl, gtop), (wt, wl, wtop) in zip(gc["logprobs"], wc["logprobs"], strict=True):
                assert gt == wt and abs(gl - wl) < 1e-3
                assert [t for t, _ in gtop] == [t for t, _ in wtop]
    reasons = {c["finish_reason"] for r in got["requests"] for c in r["outputs"]}
    assert reasons == {"stop", "length"}


def test_update_from_output_alone_advances_and_stops(tiny_dir, make_llm) -> None:
    """The three calls by hand: the scheduler's output and the runner's are plain data that survive a msgpack
    round trip, and only `update_from_output` moves the sequences on (the runner's result changes nothing)."""
    from glowplug.engine.core_frames import decode_frame, encode_frame

    llm = make_llm(tiny_dir("llama"), compile="off", cache={"block_size": 4})
    core = llm.engine.core
    stop_at = llm.generate(["The"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    stop_token = stop_at.outputs[0].token_ids[3]
    core.add(
        "r",
        llm.tokenizer("The")["input_ids"],
        SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop_token,)),
    )
    (seq,) = core.scheduler.running or list(core.scheduler.waiting)
    tokens: list[int] = []
    while core.has_unfinished():
        out = core.scheduler.schedule()
        assert decode_frame(encode_frame(out), type(out)) == out
        parts = core.runner.execute(out)
        while True:
            before = (seq.num_computed_tokens, list(seq.output_token_ids))
            part = next(parts, None)
            if part is None:
                break
            assert (seq.num_computed_tokens, seq.output_token_ids) == before  # the runner changed nothing
            assert decode_frame(encode_frame(part), type(part)) == part
            tokens += [u.token_id for u in core.scheduler.update_from_output(out, part)]
    assert tokens == stop_at.outputs[0].token_ids[:4]
    assert seq.finish_reason == "stop" and not seq.block_table
    assert llm.engine.stats().kv_used_blocks == 0


if __name__ == "__main__":
    from glowplug.engine.llm import LLM

    data = scenario(LLM(sys.argv[1], **ENGINE))
    GOLDEN.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {GOLDEN}: {msgspec.json.encode(data)[:200]!r}...")
