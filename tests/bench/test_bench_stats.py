"""The one percentile method: ordered summaries, numpy agreement, refusal of NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from glowplug.profiling.bench.stats import EmptySample, percentile, summarize
from glowplug.profiling.bench.tables import Missing, markdown_table

finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12)
samples = st.lists(finite, min_size=1, max_size=60)


@given(samples)
def test_summary_is_always_ordered(values: list[float]) -> None:
    s = summarize(values)
    assert s.min <= s.p50 <= s.p90 <= s.p99 <= s.max
    assert s.min <= s.mean <= s.max
    assert s.std >= 0
    assert s.n == len(values)


@given(samples, st.floats(0, 100), st.floats(0, 100))
def test_percentile_is_monotone_in_q(values: list[float], q1: float, q2: float) -> None:
    lo, hi = sorted((q1, q2))
    assert percentile(values, lo) <= percentile(values, hi)


@given(samples, st.sampled_from([0, 10, 50, 90, 99, 100]))
def test_matches_numpy_linear(values: list[float], q: float) -> None:
    expected = float(np.percentile(np.array(values), q, method="linear"))
    assert math.isclose(percentile(values, q), expected, rel_tol=1e-9, abs_tol=1e-6)


@given(st.lists(st.floats(0.001, 1e4), min_size=1, max_size=30))
def test_scaling_keeps_the_order(values: list[float]) -> None:
    s = summarize(values).scaled(1000.0)
    assert s.min <= s.p50 <= s.p90 <= s.p99 <= s.max


def test_known_values() -> None:
    s = summarize([4.0, 1.0, 3.0, 2.0])  # unsorted on purpose: seed 001's p90 < p50 came from unsorted samples
    assert (s.min, s.p50, s.max) == (1.0, 2.5, 4.0)
    assert s.p90 == pytest.approx(3.7)
    assert s.std == pytest.approx(math.sqrt(5 / 3))
    one = summarize([7.0])
    assert (one.p50, one.p99, one.std) == (7.0, 7.0, 0.0)


def test_refuses_empty_and_nan() -> None:
    with pytest.raises(EmptySample):
        summarize([])
    with pytest.raises(ValueError, match="non-finite"):
        summarize([1.0, float("nan")])
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_tables_refuse_blank_and_nan_cells_and_show_reasons() -> None:
    text = markdown_table(["a", "b"], [["x", Missing("KV cache: needs 34 blocks, has 20")]])
    assert "n/a (KV cache: needs 34 blocks, has 20)" in text
    with pytest.raises(ValueError, match="blank"):
        markdown_table(["a", "b"], [["x", " "]])
    with pytest.raises(ValueError, match="non-finite"):
        markdown_table(["a", "b"], [["x", float("nan")]])


def test_fmt_spread_puts_the_unit_nowhere_and_marks_a_single_run() -> None:
    from glowplug.profiling.bench.tables import fmt_spread

    assert fmt_spread([0.04], 1) == "0.0 (n=1)"
    assert fmt_spread([3.0, 1.0, 2.0, 10.0], 1) == "2.5 (1.0–10.0)"  # median of an even count: the mid-pair mean
    assert "±" not in fmt_spread([5.0, 5.0, 5.0]) and "%" not in fmt_spread([5.0])
    with pytest.raises(ValueError):
        fmt_spread([])
