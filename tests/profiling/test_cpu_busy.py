"""The contention measure counts other processes' CPU use and not this process's own (real processes)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from glowplug.profiling import cpu_busy

pytestmark = pytest.mark.skipif(cpu_busy.sample() is None, reason="no /proc/stat on this system")

BURN_S = 0.6


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def test_another_process_counts_and_our_own_work_does_not() -> None:
    start = cpu_busy.sample()
    _burn(BURN_S)
    own = cpu_busy.others_cores(start)
    child = subprocess.Popen(
        [sys.executable, "-c", f"import time\nend=time.monotonic()+{BURN_S}\nwhile time.monotonic()<end: pass"]
    )
    start = cpu_busy.sample()
    child.wait()
    other = cpu_busy.others_cores(start)
    assert own is not None and other is not None
    # One busy child is about one core of the others' use; our own busy loop is taken out.
    assert other > 0.6, other
    assert own < other - 0.4, (own, other)


def test_a_window_too_short_says_nothing() -> None:
    assert cpu_busy.others_cores(cpu_busy.sample()) is None
