"""Batch-size buckets for fixed-shape decode graphs, as plain functions (the runner and the graph_capture stage use
them; tests check them on their own).

A captured CUDA graph replays one shape: the decode step is captured once per bucket (a batch size), and a batch
runs in the smallest bucket that holds it, its spare rows being padding rows that read and write only the scratch
KV block. The graphs read their input from one static buffer, so every bucket's input is a prefix of it: bucket b's
input is the buffer's first b * cols elements viewed as [b, cols].
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

# vLLM-like defaults: dense at small batches, where decode steps are cheap and padding costs the most in relative
# terms, then coarser.
DEFAULT_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_sizes(limit: int, configured: Iterable[int] | None = None, *, include_limit: bool) -> list[int]:
    """The sizes to capture up to `limit` (--max-num-seqs): the configured ones (else DEFAULT_SIZES) that fit, plus
    `limit` itself when `include_limit` (fixed-shape graphs: every batch then has a bucket to pad up to)."""
    if limit < 1:
        raise ValueError(f"the largest batch must be at least 1 (got {limit})")
    picked = {s for s in (configured or DEFAULT_SIZES) if 1 <= s <= limit}
    if include_limit:
        picked.add(limit)
    return sorted(picked) or [1]


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The smallest of the ascending `sizes` that holds `batch` rows, or None when none does (an eager step)."""
    if batch < 1:
        raise ValueError(f"a decode batch has at least one row (got {batch})")
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def padding_rows(batch: int, sizes: list[int]) -> int:
    """How many padding rows a batch of `batch` runs with (0 when a bucket fits it exactly or there is none)."""
    bucket = bucket_for(batch, sizes)
    return 0 if bucket is None else bucket - batch


def static_span(bucket: int, cols: int, capacity: int) -> tuple[int, int]:
    """The (start, length) of bucket `bucket`'s input in a static buffer of `capacity` elements whose rows are `cols`
    wide: always the buffer's prefix, so that every graph reads where the serving path writes."""
    n = bucket * cols
    if n > capacity:
        raise ValueError(f"a batch of {bucket} rows x {cols} columns needs {n} elements; the buffer holds {capacity}")
    return 0, n
