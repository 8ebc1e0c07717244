"""The decode report's host time: a step's wall time minus what the runner books as its model call and sampler."""

from __future__ import annotations

import time
from typing import Any

import torch

from glowplug.profiling.bench.decode import make_prompts, time_engine_decode

STEP_S = 0.02  # what the installed decode step sleeps: model time, never host time


def test_host_time_leaves_out_the_model_call_and_the_sampler(tiny_model: str, make_llm: Any) -> None:
    llm = make_llm(tiny_model, compile="off", max_num_seqs=4)
    runner = llm.engine.runner

    def slow_step(packed: torch.Tensor) -> torch.Tensor:
        time.sleep(STEP_S)
        return runner.eager_decode(packed)

    runner.install_decode(slow_step, [1, 2, 3, 4])
    before = runner.step_times()
    timing = time_engine_decode(llm.engine, make_prompts(llm.tokenizer, 3, 8), 6)
    after = runner.step_times()
    steps = 5  # the first of the 6 tokens comes from the prefill
    assert after.model_ns - before.model_ns >= steps * STEP_S * 1e9  # every decode step's call was booked
    assert after.sample_ns > before.sample_ns
    assert timing.step_ms >= STEP_S * 1e3
    # The sleep is inside the model call, so none of it is host time; what is left is a tiny model's bookkeeping.
    assert 0 < timing.host_ms < STEP_S * 1e3 / 2
