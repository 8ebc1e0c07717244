"""Every frame the API server and the engine core exchange, and the step's own plain data, survive the codec: for
any value hypothesis makes, decode(encode(frame)) == frame, through the one decoder per direction (a tagged union),
so a frame is also never taken for another."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glowplug.engine import core_frames as cf
from glowplug.engine.outputs import ModelRunnerOutput, SeqUpdate, TokenLogprobs
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.scheduler import NewSeqData, SchedulerOutput
from glowplug.engine.start_estimate import PhaseEstimate, PhaseSource
from glowplug.engine.tokenizer import TokenizerShape
from glowplug.profiling.phases import PhaseRow, PhaseTable

ints = st.integers(-(2**63), 2**63 - 1)
small = st.integers(0, 2**31)
floats = st.floats(allow_nan=False)
text = st.text(max_size=12)
ids = st.lists(st.integers(0, 2**31), max_size=8)
scalar = st.one_of(text, ints, floats, st.booleans())
attr_value = st.one_of(scalar, st.lists(st.one_of(text, ints), max_size=4))
attrs = st.dictionaries(text, attr_value, max_size=4)
hexes = st.integers(0, 2**128 - 1).map(lambda v: f"{v:032x}")

params = st.builds(
    SamplingParams,
    n=st.integers(1, 16),
    temperature=st.floats(0.0, 10.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(-1, 50),
    seed=st.none() | st.integers(0, 2**63 - 1),
    max_tokens=st.integers(1, 4096),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3).map(tuple),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20),
    skip_special_tokens=st.booleans(),
)
logprobs = st.builds(TokenLogprobs, small, floats, st.dictionaries(small, floats, max_size=3))
update = st.builds(
    SeqUpdate, text, st.integers(0, 15), small, st.none() | logprobs, st.sampled_from([None, "stop", "length"]), small
)
record = st.builds(
    cf.SpanRecord,
    text,
    hexes,
    hexes.map(lambda h: h[:16]),
    st.none() | hexes.map(lambda h: h[:16]),
    ints,
    st.none() | ints,
    attrs,
    st.sampled_from(["UNSET", "OK", "ERROR"]),
    st.none() | text,
    st.lists(st.tuples(text, attrs, ints), max_size=2),
    attrs,
)
shape = st.builds(TokenizerShape, st.none() | st.integers(1, 300), st.booleans())
load = st.builds(cf.CoreLoad, *[small] * 9, st.lists(small, max_size=4), st.lists(small, max_size=4), small)
row = st.builds(
    PhaseRow,
    text,
    st.sampled_from(["leaf", "aggregate", "derived", "total", "floor"]),
    st.none() | ints,
    st.none() | text,
    attrs,
    st.lists(text, max_size=3).map(tuple),
    st.lists(text, max_size=3).map(tuple),
)
table = st.builds(
    PhaseTable, st.lists(row, max_size=4).map(tuple), st.dictionaries(text, text, max_size=3), st.none() | hexes
)

source = st.builds(
    PhaseSource, st.sampled_from(["recorded", "model"]), text, st.dictionaries(text, floats, max_size=3), st.booleans()
)
estimate = st.builds(
    PhaseEstimate,
    st.dictionaries(text, floats, max_size=4),
    st.booleans(),
    text,
    st.sampled_from(["same_pattern", "per_phase", "model"]),
    st.lists(text, max_size=2).map(tuple),
    floats,
    st.dictionaries(text, st.sampled_from(["hit", "miss", "partial", "unknown"]), max_size=3),
    st.dictionaries(text, source, max_size=3),
    st.none() | st.dictionaries(text, st.lists(text, max_size=2).map(tuple), max_size=3),
    floats,
    st.none() | floats,
    st.none() | floats,
)

TO_CORE = [
    st.builds(cf.AddRequest, text, ids, params, floats),
    st.builds(cf.AbortRequests, st.lists(text, max_size=4)),
    st.builds(cf.FinishSeq, text, st.integers(0, 15), st.sampled_from(["stop", "abort"])),
    st.builds(cf.Shutdown, text),
]
FROM_CORE = [
    st.builds(cf.SpanStarted, record),
    st.builds(cf.SpanEnded, record, st.booleans()),
    st.builds(cf.PhaseEntered, text),
    st.builds(cf.Planned, ints, st.none() | text, st.none() | estimate),
    st.builds(cf.Ready, ints, small, small, text, load, st.none() | table, small, st.none() | shape),
    st.builds(cf.Failed, text, st.none() | text, st.booleans()),
    st.builds(
        cf.StepOutputs,
        st.lists(update, max_size=6),
        st.lists(text, max_size=3),
        floats,
        st.none() | load,
        floats,
        small,
        small,
        floats,
        st.booleans(),
    ),
    st.builds(cf.Refused, text, text, st.sampled_from([400, 413, 503])),
    st.builds(cf.Notice, text, text),
]
STEP = [
    st.builds(
        SchedulerOutput,
        ids,
        ids,
        st.lists(st.builds(NewSeqData, small, text, ids, ids, params, st.none() | small, ids, small), max_size=3),
        st.dictionaries(small, ids, max_size=3),
        ids,
        st.lists(text, max_size=3),
        small,
        small,
        small,
    ),
    st.builds(
        ModelRunnerOutput,
        ids,
        st.lists(st.integers(-1, 2**31), max_size=8),
        st.none() | st.lists(st.none() | logprobs, max_size=4),
        st.booleans(),
    ),
    st.builds(
        cf.CoreSpec,
        text,
        text,
        text,
        small,
        st.none() | text,
        st.none() | ints,
        st.none() | ints,
        st.lists(record, max_size=2),
        st.booleans(),
        text,
        st.none() | st.booleans(),
        st.booleans(),
        st.none() | text,
    ),
]


def _frames(kinds: list[Any]) -> Any:
    return st.one_of(*kinds)


@settings(max_examples=300, deadline=None)
@given(frame=_frames(TO_CORE))
def test_frames_to_the_core_round_trip(frame: Any) -> None:
    assert cf.decode_frame(cf.encode_frame(frame), cf.ToCore) == frame


@settings(max_examples=300, deadline=None)
@given(frame=_frames(FROM_CORE))
def test_frames_from_the_core_round_trip(frame: Any) -> None:
    assert cf.decode_frame(cf.encode_frame(frame), cf.FromCore) == frame


@settings(max_examples=100, deadline=None)
@given(value=_frames(STEP))
def test_the_steps_plain_data_round_trips(value: Any) -> None:
    assert cf.decode_frame(cf.encode_frame(value), type(value)) == value
    if isinstance(value, cf.CoreSpec):  # the core's spec travels as JSON in the environment
        assert msgspec.json.decode(msgspec.json.encode(value), type=cf.CoreSpec) == value


def test_every_frame_type_is_covered() -> None:
    """A frame added to a direction's union without a strategy here fails this test."""
    for kind, strategies in ((cf.ToCore, TO_CORE), (cf.FromCore, FROM_CORE)):
        want = set(kind.__args__)  # type: ignore[attr-defined]
        got = {getattr(_unwrap(s), "target", None) for s in strategies}
        assert got == want, f"no strategy for {sorted(k.__name__ for k in want - got)}"


def _unwrap(strategy: Any) -> Any:
    while hasattr(strategy, "wrapped_strategy"):
        strategy = strategy.wrapped_strategy
    return strategy


def test_a_frame_of_the_wrong_direction_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        cf.decode_frame(cf.encode_frame(cf.Shutdown("bye")), cf.FromCore)
