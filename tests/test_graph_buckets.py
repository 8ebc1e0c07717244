"""Batch buckets and the static input buffer of fixed-shape decode graphs (engine/graph_buckets.py), and the
runner's padding to them; on a CPU, through the runner with padding switched on as a CUDA runner has it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glowplug.engine.graph_buckets import DEFAULT_SIZES, bucket_for, bucket_sizes, padding_rows, static_span


def test_sizes_fit_the_limit_and_include_it_when_asked() -> None:
    assert bucket_sizes(8, include_limit=True) == [1, 2, 4, 8]
    assert bucket_sizes(10, include_limit=True) == [1, 2, 4, 8, 10]
    assert bucket_sizes(10, include_limit=False) == [1, 2, 4, 8]
    assert bucket_sizes(300, include_limit=False) == list(DEFAULT_SIZES)
    assert bucket_sizes(5, (3, 64), include_limit=True) == [3, 5]
    assert bucket_sizes(2, (64,), include_limit=False) == [1]  # nothing fits: batch 1 still has a size
    with pytest.raises(ValueError, match="at least 1"):
        bucket_sizes(0, include_limit=True)


@given(limit=st.integers(1, 300), batch=st.integers(1, 300))
def test_every_batch_up_to_the_limit_has_the_smallest_bucket_that_holds_it(limit: int, batch: int) -> None:
    sizes = bucket_sizes(limit, include_limit=True)
    bucket = bucket_for(batch, sizes)
    if batch > limit:
        assert bucket is None and padding_rows(batch, sizes) == 0
        return
    assert bucket is not None and bucket >= batch
    assert all(s < batch for s in sizes if s < bucket)  # no smaller size would do
    assert padding_rows(batch, sizes) == bucket - batch


def test_bucket_rejects_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        bucket_for(0, [1, 2])


def test_every_bucket_reads_a_prefix_of_the_static_buffer() -> None:
    assert static_span(4, 12, 8 * 12) == (0, 48)
    with pytest.raises(ValueError, match="holds 96"):
        static_span(9, 12, 96)
