"""The expected-wait model behind admission (lifecycle/admission.py) and the prompt tokens a ticket holds: the
prompt cost recovered from step times, the lengths sequences run to (stopped or cut at max_tokens), the slot wait
against the real scheduler's, and the service's queued token count going back to zero whichever way a request
leaves."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lifecycle_harness import engine_config

from glowplug.engine.core_frames import CoreLoad
from glowplug.lifecycle.admission import OutputLengths, StepCost, expected_wait_s, slot_wait_s, theil_sen
from glowplug.lifecycle.generation import Ticket


def test_prefill_cost_separates_the_fixed_part_from_the_per_token_part() -> None:
    """Steps of mixed sizes on a line (60 ms fixed + 0.6 ms a token, the shape measured on the 2-core CPU): the fit
    recovers both, so ten tokens after a cached prefix are not priced at 6 ms each."""
    cost = StepCost()
    for n in (10, 332, 40, 302, 10, 332, 30, 312, 128, 2048):
        cost.observe(0.060 + 0.0006 * n, n)
    assert cost.fit is not None
    assert cost.fit.fixed_s == pytest.approx(0.060) and cost.fit.per_s == pytest.approx(0.0006)
    assert cost.seconds(1000) == pytest.approx(0.66)
    assert cost.seconds(0) == 0.0


def test_prefill_cost_shrugs_off_slow_steps_and_waits_for_enough_of_them() -> None:
    cost = StepCost()
    cost.observe(4.5, 488)  # the first step after READY, beside the KV pool's commit
    cost.observe(0.030 + 0.0005 * 100, 100)
    assert cost.fit is None and cost.seconds(100) is None  # 2 steps: one of them may be that slow first one
    cost.observe(0.030 + 0.0005 * 200, 200)
    assert cost.seconds(200) == pytest.approx(0.130, rel=0.3)  # the median of three already sets it aside
    for n in (300, 400, 500, 600, 700):
        cost.observe(0.030 + 0.0005 * n, n)
    cost.observe(2.0, 64)  # a stall
    assert cost.fit is not None
    assert cost.fit.per_s == pytest.approx(0.0005, rel=0.05) and cost.fit.fixed_s == pytest.approx(0.030, rel=0.2)


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


def test_lengths_cut_at_max_tokens_say_only_that_sequences_run_that_long() -> None:
    """Kaplan-Meier over finished lengths: requests that all ran to their max_tokens (censored) tell nothing about
    where a sequence stops by itself, so a running one is expected to run to its own max_tokens, longer or not."""
    lengths = OutputLengths()
    for _ in range(20):
        lengths.note(64, stopped=False)
    assert lengths.steps_left(10, 64) == 54
    assert lengths.steps_left(10, 200) == 190
    assert lengths.typical_run() == 64


def test_lengths_of_sequences_that_stopped_by_themselves_bound_the_running_ones() -> None:
    lengths = OutputLengths()
    for n in range(1, 101):  # stopped at 1..100 tokens
        lengths.note(n, stopped=True)
    # Past 50 tokens, 90% of those still running stop by 95 (the quantile among the longer ones only).
    assert lengths.steps_left(50, 1000) == 45
    assert lengths.steps_left(50, 60) == 10  # max_tokens comes first
    assert lengths.steps_left(100, 1000) == 900  # past every stop seen: nothing but max_tokens says when it ends
    assert lengths.typical_run() == 90
    # Half of them cut at max_tokens 40 instead: the stops past 40 are still read as where those would stop.
    mixed = OutputLengths()
    for n in range(1, 101):
        mixed.note(min(n, 40), stopped=n <= 40)
    assert mixed.steps_left(50, 1000) == 950  # none of the cut ones was seen to stop: no say past 40


def test_slot_wait_hands_the_slots_out_in_turn() -> None:
    # A free slot per waiting sequence: no wait.
    assert slot_wait_s(ahead_seqs=2, free_slots=2, running_left_s=[5.0, 1.0], run_s=9.0) == 0.0
    # The third waits for the sooner of the two running ones.
    assert slot_wait_s(ahead_seqs=3, free_slots=2, running_left_s=[5.0, 1.0], run_s=9.0) == 1.0
    # One free slot and three running: the 3rd in line gets the 2nd slot to free up.
    assert slot_wait_s(ahead_seqs=3, free_slots=1, running_left_s=[4.0, 2.0, 3.0], run_s=9.0) == 3.0
    # More waiting than slots: the first ones in line take the slots and hold them for run_s.
    assert slot_wait_s(ahead_seqs=4, free_slots=0, running_left_s=[1.0, 2.0], run_s=0.5) == 2.0
    # The slot that frees at 1 s serves three in turn (1, 1.5, 2), the 4th gets it at 2.5, before the other frees.
    assert slot_wait_s(ahead_seqs=4, free_slots=0, running_left_s=[1.0, 5.0], run_s=0.5) == 2.5


def test_admission_from_recorded_core_states_matches_the_real_schedule(tiny_model: Path) -> None:
    """The real engine on 2 slots runs requests of 5, 9 and 20 tokens (the third waits); after each of its steps,
    admission reads the state the core reports (load_of, as the core process sends it) and predicts the wait of one
    more request, which is then added to the engine. The oracle is the scheduler: the steps the engine runs before
    it schedules the new request. Step time is booked as 1 s a step, so the prediction is in steps; the 429 decision
    at --max-queue-wait 4 must match whether the real wait was within 4 steps."""
    from glowplug.engine.core_proc import load_of
    from glowplug.engine.llm import LLM
    from glowplug.engine.sampling_params import SamplingParams
    from glowplug.lifecycle.admission import Admission, Rejected
    from glowplug.lifecycle.config import ServeConfig
    from glowplug.lifecycle.core_client import StepReport
    from glowplug.lifecycle.metrics import ServiceMetrics
    from glowplug.lifecycle.state import EngineState, StateSnapshot

    core = LLM(config=engine_config(tiny_model, max_num_seqs=2)).engine.core
    reported: list[CoreLoad | None] = [None]
    ready = StateSnapshot(EngineState.READY, None, None, (), 0.0, 0.0, 0.0)
    adm = Admission(
        ServeConfig(max_queue_wait=4.0),
        ServiceMetrics(),
        state=lambda: ready,
        eta_s=lambda _snap: None,
        load=lambda: reported[0],
    )
    prompt = list(range(5, 13))

    def run(probe_after: int | None) -> tuple[float | None, bool, int | None]:
        """One pass; (predicted wait, admitted, steps run before the probe was scheduled) for the probe."""
        reported[0] = None  # the passes' requests come in on an idle server
        tickets = {rid: adm.admit(1) for rid in ("r1", "r2", "w1")}
        for rid, n in (("r1", 5), ("r2", 9), ("w1", 20)):
            core.add(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        generated: dict[str, int] = {}
        predicted, admitted, waited, step = None, False, None, 0
        while core.has_unfinished():
            updates = core.step()
            step += 1
            for rid in core.last_first_scheduled:  # the server gives a ticket back when its request is scheduled
                ticket = tickets.pop(rid, None)  # none for a refused probe (added all the same, to time it)
                if ticket is not None:
                    ticket.release_all()
                if rid == "probe":
                    assert probe_after is not None
                    waited = step - probe_after - 1
            shape = core.last_step
            adm.observe_step(StepReport(1.0, shape.prefill_tokens, shape.decode_rows, 0.0))
            for u in updates:
                generated[u.request_id] = generated.get(u.request_id, 0) + 1
                if u.finish_reason is not None:
                    adm.note_finished([(generated[u.request_id], u.finish_reason != "length")])
            reported[0] = load_of(core)
            if step == probe_after:
                predicted = adm.expected_wait_s(1)
                try:
                    tickets["probe"] = adm.admit(1)
                    admitted = True
                except Rejected as exc:
                    assert exc.status == 429 and exc.retry_after is not None and exc.retry_after >= 5
                core.add("probe", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        return predicted, admitted, waited

    run(None)  # the server has seen this workload: its step time and how long its requests run
    outcomes = {t: run(t) for t in range(1, 12)}
    for t, (predicted, admitted, waited) in outcomes.items():
        assert waited is not None
        assert predicted == pytest.approx(waited), f"probe after step {t}"
        assert admitted == (waited <= 4.0), f"probe after step {t}"
    waits = [w for _, _, w in outcomes.values()]
    assert max(waits) == 8 and min(waits) == 0  # both ways of the decision were tried
    assert not adm._queued  # every ticket was given back


def test_wait_is_the_slot_wait_plus_the_prompt_work_ahead() -> None:
    assert expected_wait_s(slot_wait_s=0.7, prompt_wait_s=0.1) == pytest.approx(0.8)
    # One term unknown (no step measured yet): the other is still a lower bound worth checking.
    assert expected_wait_s(slot_wait_s=None, prompt_wait_s=0.1) == pytest.approx(0.1)
    assert expected_wait_s(slot_wait_s=None, prompt_wait_s=None) is None


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
