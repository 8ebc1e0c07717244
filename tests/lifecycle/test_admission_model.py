"""The expected-wait model behind admission (lifecycle/admission.py) and the prompt tokens a ticket holds: the
per-token prefill cost recovered from step times, the slot and prompt terms of the wait, and the service's queued
token count going back to zero whichever way a request leaves."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lifecycle_harness import engine_config

from glowplug.lifecycle.admission import FinishRate, PrefillCost, expected_wait_s, theil_sen
from glowplug.lifecycle.generation import Ticket


def test_prefill_cost_separates_the_fixed_part_from_the_per_token_part() -> None:
    """Steps of mixed sizes on a line (60 ms fixed + 0.6 ms a token, the shape measured on the 2-core CPU): the fit
    recovers both, so ten tokens after a cached prefix are not priced at 6 ms each."""
    cost = PrefillCost()
    for n in (10, 332, 40, 302, 10, 332, 30, 312, 128, 2048):
        cost.observe(0.060 + 0.0006 * n, n)
    assert cost.fit is not None
    assert cost.fit.fixed_s == pytest.approx(0.060) and cost.fit.token_s == pytest.approx(0.0006)
    assert cost.seconds(1000) == pytest.approx(0.66)
    assert cost.seconds(0) == 0.0


def test_prefill_cost_shrugs_off_slow_steps_and_waits_for_enough_of_them() -> None:
    cost = PrefillCost()
    cost.observe(4.5, 488)  # the first step after READY, beside the KV pool's commit
    for n in (100, 200, 300, 400, 500, 600):
        cost.observe(0.030 + 0.0005 * n, n)
    assert cost.fit is None and cost.seconds(100) is None  # 7 steps: too few to trust
    cost.observe(0.030 + 0.0005 * 700, 700)
    cost.observe(2.0, 64)  # a stall
    assert cost.fit is not None
    assert cost.fit.token_s == pytest.approx(0.0005, rel=0.05) and cost.fit.fixed_s == pytest.approx(0.030, rel=0.2)


def test_prefill_cost_with_one_prompt_size_charges_it_all_per_token() -> None:
    fit = theil_sen([(128, 0.040)] * 8)
    assert fit.fixed_s == 0.0 and fit.seconds(256) == pytest.approx(0.080)


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
    # Free slot, nothing ahead: no wait.
    assert expected_wait_s(ahead_seqs=1, free_slots=1, finish_rate=None, prompt_wait_s=0.0) == 0.0
    # Free slot, but prompt work ahead.
    assert expected_wait_s(ahead_seqs=1, free_slots=4, finish_rate=5.0, prompt_wait_s=0.077) == pytest.approx(0.077)
    # No free slot: 3 sequences must finish first at 5 per second, then the prompt work.
    assert expected_wait_s(ahead_seqs=3, free_slots=0, finish_rate=5.0, prompt_wait_s=0.1) == pytest.approx(0.7)
    # The slot wait unknown (no finish yet): the prompt work alone is still a lower bound worth checking.
    assert expected_wait_s(ahead_seqs=3, free_slots=0, finish_rate=None, prompt_wait_s=0.1) == pytest.approx(0.1)
    assert expected_wait_s(ahead_seqs=3, free_slots=0, finish_rate=None, prompt_wait_s=None) is None


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
