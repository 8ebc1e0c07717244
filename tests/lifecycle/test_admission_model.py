"""The expected-wait model behind admission (lifecycle/admission.py) and the prompt tokens a ticket holds: the
per-token prefill cost recovered from step times, the slot and prompt terms of the wait, and the service's queued
token count going back to zero whichever way a request leaves."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glowplug.lifecycle.admission import FinishRate, PrefillCost, expected_wait_s
from glowplug.lifecycle.generation import Ticket

from lifecycle_harness import engine_config


def test_prefill_cost_follows_the_timed_prompt_part() -> None:
    cost = PrefillCost()
    for _ in range(40):
        cost.observe(128 * 0.0003, 128)
    assert cost.token_s == pytest.approx(0.0003)
    cost.observe(64 * 0.05, 64)  # one step that stalled: the estimate does not move
    assert cost.token_s == pytest.approx(0.0003)
    for _ in range(40):  # the machine got slower: the estimate follows within a few dozen steps
        cost.observe(256 * 0.0006, 256)
    assert cost.token_s == pytest.approx(0.0006)


def test_prefill_cost_ignores_steps_with_few_prompt_tokens() -> None:
    cost = PrefillCost()
    cost.observe(0.5, 3)  # a 3-token prompt: the call's fixed cost would read as 0.17 s per token
    cost.observe(0.0, 0)  # a decode-only step
    assert cost.token_s is None
    cost.observe(0.032, 64)
    assert cost.token_s == pytest.approx(0.0005)


def test_engine_times_the_prompt_part_of_a_mixed_step(tiny_model: Path) -> None:
    """The real engine: a step that computes a prompt reports its prompt tokens and a positive time for them; a
    decode-only step reports none."""
    from glowplug.engine.llm import LLM
    from glowplug.engine.sampling_params import SamplingParams

    llm = LLM(config=engine_config(tiny_model, max_num_seqs=4))
    eng = llm.engine
    eng.add_request(None, SamplingParams(max_tokens=8, ignore_eos=True), prompt_token_ids=list(range(5, 45)))
    eng.step()
    assert eng.last_step.prefill_tokens == 40 and eng.last_step.prefill_s > 0.0
    eng.step()
    assert eng.last_step.prefill_tokens == 0 and eng.last_step.decode_rows == 1 and eng.last_step.prefill_s == 0.0


def test_finish_rate_counts_up_to_now() -> None:
    rate = FinishRate()
    assert rate.per_second(now=100.0) is None
    for t in (91.0, 92.0, 93.0, 94.0):
        rate.note(t)
    assert rate.per_second(now=95.0) == pytest.approx(4 / 4.0)
    # A stall since the last end lowers the rate; ends older than the window drop out.
    assert rate.per_second(now=99.0) == pytest.approx(4 / 8.0)
    assert rate.per_second(now=200.0) is None


def test_wait_is_the_slot_wait_plus_the_prompt_work_ahead() -> None:
    # Free slot, nothing ahead: no wait, whatever the per-token cost.
    assert expected_wait_s(ahead_seqs=1, free_slots=1, finish_rate=None, ahead_prompt_tokens=0,
                           prompt_token_s=0.001) == 0.0  # fmt: skip
    # Free slot, but 256 prompt tokens admitted ahead at 0.3 ms each.
    assert expected_wait_s(ahead_seqs=1, free_slots=4, finish_rate=5.0, ahead_prompt_tokens=256,
                           prompt_token_s=0.0003) == pytest.approx(0.0768)  # fmt: skip
    # No free slot: 3 sequences must finish first at 5 per second, then the prompt work.
    assert expected_wait_s(ahead_seqs=3, free_slots=0, finish_rate=5.0, ahead_prompt_tokens=100,
                           prompt_token_s=0.001) == pytest.approx(0.6 + 0.1)  # fmt: skip
    # The slot wait unknown (no finish yet): the prompt work alone is still a lower bound worth checking.
    assert expected_wait_s(ahead_seqs=3, free_slots=0, finish_rate=None, ahead_prompt_tokens=100,
                           prompt_token_s=0.001) == pytest.approx(0.1)  # fmt: skip
    assert expected_wait_s(ahead_seqs=3, free_slots=0, finish_rate=None, ahead_prompt_tokens=0,
                           prompt_token_s=None) is None  # fmt: skip


@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=8),
    releases=st.lists(st.integers(1, 3), max_size=6),
)
def test_ticket_gives_back_exactly_the_tokens_it_holds(lengths: list[int], releases: list[int]) -> None:
    given_back = {"slots": 0, "tokens": 0}

    def on_release(slots: int, tokens: int) -> None:
        given_back["slots"] += slots
        given_back["tokens"] += tokens

    ticket = Ticket(len(lengths), on_release)
    ticket.hold_tokens(lengths)
    for n in releases:  # some prompts scheduled...
        ticket.release(n)
    ticket.release_all()  # ...then the request ends
    ticket.release_all()
    assert given_back == {"slots": len(lengths), "tokens": sum(lengths)}
