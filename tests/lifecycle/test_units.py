"""The pieces without a server: life-cycle transitions and ETA, ServeConfig and its flags, error field paths."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from glowplug.lifecycle.config import ServeConfig, add_serve_flags, serve_config_from_args
from glowplug.lifecycle.errors import param_path
from glowplug.lifecycle.state import EngineState, InvalidTransition, Lifecycle, estimate_remaining


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_are_timed_from_on_phase_calls() -> None:
    clock = FakeClock()
    lc = Lifecycle(clock)
    seen: list[EngineState] = []
    lc.subscribe(lambda snap: seen.append(snap.state))
    lc.enter_phase("load_weights")
    clock.now += 2.0
    lc.enter_phase("warmup")
    clock.now += 0.5
    snap = lc.snapshot()
    assert snap.state is EngineState.STARTING and snap.phase == "warmup" and snap.phase_elapsed_s == 0.5
    assert snap.phase_seconds() == {"load_weights": 2.0}
    clock.now += 0.5
    assert lc.mark_ready()
    clock.now += 10.0
    snap = lc.snapshot()
    assert snap.state is EngineState.READY and snap.phase is None
    assert snap.phase_seconds() == {"load_weights": 2.0, "warmup": 1.0}
    assert snap.startup_elapsed_s == 3.0  # frozen at READY
    assert lc.begin_drain() and not lc.begin_drain()
    lc.mark_stopped()
    assert seen == [
        EngineState.STARTING,
        EngineState.STARTING,
        EngineState.READY,
        EngineState.DRAINING,
        EngineState.STOPPED,
    ]


def test_unsubscribe_stops_the_listener_and_is_idempotent() -> None:
    """Lifecycle and StartupTimeline share lifecycle.subscribers.Subscribers: a listener unsubscribed is not
    called again, and calling unsubscribe twice is harmless."""
    lc = Lifecycle(FakeClock())
    seen: list[str] = []
    stop = lc.subscribe(lambda snap: seen.append(f"a:{snap.phase}"))
    lc.subscribe(lambda snap: seen.append(f"b:{snap.phase}"))
    lc.enter_phase("load_weights")
    stop()
    stop()
    lc.enter_phase("warmup")
    assert seen == ["a:load_weights", "b:load_weights", "b:warmup"]


def test_failure_and_late_transitions() -> None:
    clock = FakeClock()
    lc = Lifecycle(clock)
    lc.enter_phase("load_weights")
    clock.now += 1.0
    assert lc.mark_failed("load_weights: OSError: disk gone")
    snap = lc.snapshot()
    assert snap.state is EngineState.FAILED and snap.reason == "load_weights: OSError: disk gone"
    assert snap.finished_phases[-1].failed and snap.finished_phases[-1].seconds == 1.0
    assert not lc.mark_ready() and not lc.begin_drain()
    lc.mark_stopped()
    assert not lc.mark_failed("again")

    drained = Lifecycle(clock)
    assert drained.begin_drain()
    assert not drained.mark_ready()  # a start that finishes after the drain began never becomes READY
    with pytest.raises(InvalidTransition):
        Lifecycle(clock).mark_stopped()  # STARTING -> STOPPED skips the drain


def test_eta_counts_what_is_left() -> None:
    clock = FakeClock()
    lc = Lifecycle(clock)
    expected = {"tokenizer_init": 1.0, "load_weights": 4.0, "warmup": 2.0}
    assert estimate_remaining(lc.snapshot(), None) is None
    lc.enter_phase("tokenizer_init")
    clock.now += 1.0
    lc.enter_phase("load_weights")
    clock.now += 1.5
    assert estimate_remaining(lc.snapshot(), expected) == pytest.approx(2.5 + 2.0)
    # Stages that ran at once in the recorded start (wall / sum = 0.5) shorten the rest, never below its longest.
    assert estimate_remaining(lc.snapshot(), expected, 0.5) == pytest.approx(2.5)
    assert estimate_remaining(lc.snapshot(), expected, 0.1) == pytest.approx(2.5)
    clock.now += 10.0  # overrunning the profile: "any moment", never negative
    assert estimate_remaining(lc.snapshot(), expected) == pytest.approx(2.0)
    lc.mark_ready()
    assert estimate_remaining(lc.snapshot(), expected) == 0.0


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"port": 70000}, "port"),
        ({"drain_timeout": -1}, "drain_timeout"),
        ({"max_queue": 0}, "max_queue"),
        ({"ready_wait": -0.5}, "ready_wait"),
        ({"log_level": "loud"}, "log_level"),
        ({"host": " "}, "host"),
        ({"max_qeue": 3}, "max_qeue"),
    ],
)
def test_serve_config_rejects(fields: dict, bad: str) -> None:
    with pytest.raises(ValidationError) as info:
        ServeConfig(**fields)
    assert info.value.errors()[0]["loc"][0] == bad


def test_serve_flags_map_onto_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(["--port", "9001", "--max-queue", "5", "--drain-timeout", "2.5", "--log-level", "DEBUG"])
    cfg = serve_config_from_args(args)
    assert (cfg.port, cfg.max_queue, cfg.drain_timeout, cfg.log_level) == (9001, 5, 2.5, "debug")
    assert cfg.host == "127.0.0.1" and cfg.ready_wait == ServeConfig().ready_wait
    with pytest.raises(ValidationError):
        cfg.port = 1  # frozen, like EngineConfig
    assert cfg.model_name("smollm2") == "smollm2"
    assert ServeConfig(served_model_name="x").model_name("smollm2") == "x"


@pytest.mark.parametrize(
    ("loc", "want"),
    [
        (("max_tokens",), "max_tokens"),
        (("messages", 0, "content", "str"), "messages[0].content"),
        (("messages", 2, "content", "list[TextPart]", 1, "text"), "messages[2].content[1].text"),
        (("prompt", "list[int]", 3), "prompt[3]"),
        ((), None),
    ],
)
def test_param_paths_name_what_the_user_wrote(loc: tuple, want: str | None) -> None:
    assert param_path(loc) == want


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_an_sse_event_is_one_line_for_any_line_splitter(text: str) -> None:
    """Generated text can hold U+2028, U+0085 and the like: an event must still be one `data:` line to splitters
    that cut on them (httpx's iter_lines uses str.splitlines), and its JSON must give the text back."""
    from glowplug.lifecycle.responses import sse

    lines = sse({"text": text}).decode().splitlines()
    assert lines[1:] == [""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == {"text": text}


def test_tokens_finished_for_a_client_that_left_are_counted_once() -> None:
    """The race the soak found: the engine finishes a request just as its client hangs up. Its final output is
    either already queued (unread) when the response closes, or still on its way; either way its tokens count as
    undelivered, once, and a request the engine still had is left to the engine loop's own count."""
    import asyncio

    from glowplug.engine.llm_engine import CompletionOutput, RequestOutput
    from glowplug.lifecycle.generation import Generation, Ticket

    def finished(rid: str, n: int) -> RequestOutput:
        return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "x" * n, list(range(n)), "length")], True)

    async def scenario() -> tuple[list[int], list[str]]:
        undelivered: list[int] = []
        aborted: list[str] = []
        gen = Generation(
            request_ids=["queued", "late", "running"],
            prompt_lengths=[2, 2, 2],
            received_at=0.0,
            ticket=Ticket(3, lambda _n, _t: None),
            abort=aborted.append,
            observe=lambda *_a: None,
            on_close=lambda _g: None,
            undelivered=undelivered.append,
        )
        gen.sink(finished("queued", 7))  # arrived, never read: the client left first
        gen.close()
        gen.sink(finished("late", 5))  # the engine finished it before the abort reached it
        gen.sink(finished("late", 5))  # (a repeat must not count twice)
        gen.close()
        return undelivered, aborted

    undelivered, aborted = asyncio.run(scenario())
    assert sorted(undelivered) == [5, 7]
    assert sorted(aborted) == ["late", "queued", "running"]  # the engine loop counts what it still held
