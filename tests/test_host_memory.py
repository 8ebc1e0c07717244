"""Host buffers for the KV pool: zero-filled, committed by the kernel when asked (read back from /proc), and the
native-cache and heap settings of a server process."""

from __future__ import annotations

import sys

import pytest
import torch

from glowplug.engine.host_memory import anonymous_zeros, commit, limit_native_caches, release_free_heap
from glowplug.engine.kv_cache import KVCache

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def resident_kib(t: torch.Tensor) -> int:
    """Rss of the mapping that holds `t`, from the kernel's own accounting."""
    addr = t.data_ptr()
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= addr < hi:
                rss = next(x for x in lines[i + 1 :] if x.startswith("Rss:"))
                return int(rss.split()[1])
    raise AssertionError("no mapping holds the tensor")


@linux_only
def test_an_anonymous_buffer_is_zero_and_commits_only_when_asked() -> None:
    nbytes = 48 << 20
    t = anonymous_zeros(nbytes)
    assert t.numel() == nbytes and t.dtype == torch.uint8
    assert resident_kib(t) < 8 << 10  # nothing touched yet
    assert commit([t]) is True
    assert resident_kib(t) >= nbytes >> 10
    assert int(t.count_nonzero()) == 0  # populating writes no data


@linux_only
def test_the_kv_cache_commits_every_layer_and_reads_back_zeros() -> None:
    cache = KVCache(
        num_layers=3, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, int8=True
    )
    tensors = cache.tensors()
    assert len(tensors) == 3 * 4  # k, v and both scale tensors per layer
    assert sum(t.nbytes for t in tensors) == cache.nbytes
    assert cache.commit() is True
    for t in tensors:
        assert resident_kib(t) * 1024 >= t.nbytes // 4096 * 4096
        assert int(t.view(torch.uint8).count_nonzero()) == 0
    # Writes through the layer's views land in the committed mapping.
    layer = cache[1]
    k = torch.randn(2, 2, 64, dtype=torch.bfloat16)
    layer.store(k, k, torch.tensor([5, 17]))
    got, _ = cache.gather(1, torch.tensor([0, 1]), 18, torch.float32)
    assert torch.allclose(got[5], k[0].float(), atol=0.05, rtol=0.02)


def test_native_cache_limit_respects_the_operators_setting() -> None:
    env: dict[str, str] = {}
    limit_native_caches(env)
    assert int(env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) > 0
    mine = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7"}
    limit_native_caches(mine)
    assert mine["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_free_heap_returns_freed_pages() -> None:
    def rss_kib() -> int:
        return int(next(x for x in open("/proc/self/status") if x.startswith("VmRSS")).split()[1])

    # Many 64 KiB blocks (below glibc's mmap threshold, so they live in the heap); free all but the last one,
    # which pins the heap's top so that free() alone cannot shrink it.
    blocks = [torch.ones(16 << 10, dtype=torch.float32) for _ in range(2048)]
    keep = blocks[-1]
    del blocks
    before = rss_kib()
    assert release_free_heap() is True
    assert rss_kib() < before - (32 << 10)  # at least 32 of the ~128 MiB freed went back
    assert float(keep.sum()) == 16 << 10
