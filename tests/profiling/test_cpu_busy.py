"""The contention measure counts other processes' CPU use and not this process's own (real processes)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from glowplug.profiling import cpu_busy

pytestmark = pytest.mark.skipif(cpu_busy.sample() is None, reason="no /proc/stat on this system")

BURN_S = 0.6
# Above this many cores kept busy by other processes while we sleep, a one-core difference cannot be told apart.
QUIET_CORES = 0.3


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def _idle_others() -> float:
    """The other processes' use while this one sleeps: the machine's background load."""
    start = cpu_busy.sample()
    time.sleep(BURN_S)
    cores = cpu_busy.others_cores(start)
    assert cores is not None
    return cores


def _skip_unless_quiet(cores: float, when: str) -> None:
    if cores > QUIET_CORES:
        pytest.skip(f"other processes kept {cores:.2f} cores busy {when} (over {QUIET_CORES}): too loaded to measure")


def test_another_process_counts_and_our_own_work_does_not() -> None:
    before = _idle_others()
    _skip_unless_quiet(before, "before the test")
    start = cpu_busy.sample()
    _burn(BURN_S)
    own = cpu_busy.others_cores(start)
    child = subprocess.Popen(
        [sys.executable, "-c", f"import time\nend=time.monotonic()+{BURN_S}\nwhile time.monotonic()<end: pass"]
    )
    start = cpu_busy.sample()
    child.wait()
    other = cpu_busy.others_cores(start)
    after = _idle_others()
    _skip_unless_quiet(after, "after the test")
    background = max(before, after)
    assert own is not None and other is not None
    # One busy child is about one core above the background; our own busy loop is taken out (counted, it would
    # be one core above the background too). Each bound is halfway between the right and the wrong answer.
    assert other > background + 0.5, (other, background)
    assert own < background + 0.5, (own, background)


def test_a_window_too_short_says_nothing() -> None:
    assert cpu_busy.others_cores(cpu_busy.sample()) is None
