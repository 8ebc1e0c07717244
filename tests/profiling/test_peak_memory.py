"""Peak memory windows: the kernel high-water mark (reset via clear_refs) and the sampling fallback."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

from glowplug.profiling.memory import PeakMemory, device_memory, reset_peak_rss

MIB = 1 << 20


def _touch(n: int) -> bytearray:
    # bytearray(n) can be backed by untouched zero pages; writing every page makes it resident.
    block = bytearray(n)
    block[::4096] = b"\x01" * len(range(0, n, 4096))
    return block


@pytest.mark.skipif(not reset_peak_rss(), reason="kernel does not allow resetting VmHWM")
def test_vmhwm_window_sees_a_freed_allocation() -> None:
    with PeakMemory("cpu") as window:
        block = _touch(96 * MIB)
        del block
    snap = window.snapshot
    assert snap is not None and snap.method == "proc_vmhwm"
    assert snap.peak_increase_bytes >= 90 * MIB
    assert snap.end_bytes < snap.peak_bytes - 80 * MIB  # it was freed, the peak remembers it


def test_sampling_fallback_sees_a_held_allocation() -> None:
    window = PeakMemory("cpu", method="sampling", interval_s=0.001)
    window.start()
    block = _touch(96 * MIB)
    time.sleep(0.05)
    del block
    snap = window.stop()
    assert snap.method == "rss_sampling"
    assert snap.peak_increase_bytes >= 90 * MIB


def test_small_window_reports_no_large_increase() -> None:
    with PeakMemory("cpu") as window:
        sum(range(1000))
    assert window.snapshot is not None and window.snapshot.peak_increase_bytes < 32 * MIB


def test_device_memory_on_cpu_matches_psutil() -> None:
    mem = device_memory("cpu")
    vm = psutil.virtual_memory()
    assert mem.total_bytes == vm.total
    assert 0 < mem.available_bytes <= mem.total_bytes


def test_bad_method_and_stop_before_start() -> None:
    with pytest.raises(ValueError):
        PeakMemory("cpu", method="guess")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        PeakMemory("cpu").stop()


@pytest.mark.cuda
def test_cuda_allocator_peak() -> None:
    with PeakMemory("cuda") as window:
        x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
        del x
    snap = window.snapshot
    assert snap is not None and snap.method == "cuda_allocator"
    assert snap.peak_increase_bytes >= 256 * MIB
    assert snap.total_bytes >= snap.available_bytes > 0


def test_live_tensor_peak_sees_reused_heap_and_ignores_views_of_old_memory() -> None:
    import torch

    from glowplug.profiling.memory import LiveTensorPeak

    n = 8 << 20  # 8 Mi floats = 32 MiB
    warm = torch.ones(n)  # heap the allocator will hand out again: RSS would not grow a second time
    del warm
    weight = torch.ones(1024, 1024)
    with LiveTensorPeak() as live:
        a = torch.ones(n)  # 32 MiB
        b = a * 2  # +32 MiB -> 64 MiB live
        del a
        c = b + 1  # 32 + 32 -> still 64 MiB
        del b, c
        view = weight.t()  # a view of memory from before the window: not new
        view.sum()
    assert live.peak_bytes >= 2 * n * 4
    assert live.peak_bytes < 2 * n * 4 + (1 << 20)  # the view and the small sum are not 4 MiB of new memory
    assert live.live_bytes <= 1024  # everything made inside was released (the sum's scalar at most)


def test_live_tensor_peak_is_per_thread() -> None:
    import threading

    import torch

    from glowplug.profiling.memory import LiveTensorPeak

    other = threading.Thread(target=lambda: torch.ones(16 << 20).sum())
    with LiveTensorPeak() as live:
        other.start()
        other.join()
        torch.ones(1024).sum()
    assert live.peak_bytes < 1 << 20  # the other thread's 64 MiB is not this window's
