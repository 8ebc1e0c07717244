"""Pre-main timing: process creation from the OS, main entry and imports marks, recorded as real spans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from glowplug.profiling.process import mark_main_entry, process_create_time

# A stand-in CLI: it sleeps before "main" (like a slow interpreter start) and during "imports".
_CHILD = r"""
import time
time.sleep(0.3)
from glowplug.profiling.process import mark_main_entry
marks = mark_main_entry()
time.sleep(0.2)
marks.mark_imports_done()
import json
from glowplug.profiling.phases import build_phase_table, to_dict
from glowplug.profiling.process import open_startup_span
from glowplug.profiling.tracing import setup_tracing
from glowplug.engine.stages.protocol import StageReport, StartupContext
from glowplug.engine.stages.runner import run_stages

class Tokenizer:
    name = "tokenizer_init"
    needs = ()
    provides = ()
    def run(self, ctx):
        time.sleep(0.05)
        return StageReport()

tracing = setup_tracing()
tracer = tracing.tracer()
root = open_startup_span(tracer, marks)
run_stages([Tokenizer()], StartupContext(None), tracer=tracer, parent=root, clock=marks.clock)
ready = marks.clock.now_ns()
root.end(end_time=ready)
data = to_dict(build_phase_table(tracing.finished_spans(), ready_time_ns=ready))
# A fresh process is the one place the once-per-process global provider can be tested.
from opentelemetry import trace
tracing.install_global()
data["global_provider_installed"] = trace.get_tracer_provider() is tracing.provider
print(json.dumps(data))
"""


def test_pre_main_rows_in_a_fresh_process() -> None:
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    elapsed = time.time() - started
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    phases = data["phases"]
    assert phases["process_start"] >= 0.3 - 0.011  # creation time has one clock tick of resolution
    assert 0.2 <= phases["imports"] < 1.0  # the child's sleep, and whatever a loaded machine adds to it
    assert phases["tokenizer_init"] >= 0.05
    assert phases["actual_total_time"] <= elapsed + 0.011
    assert sum(v for k, v in phases.items() if data["kinds"][k] == "leaf" and v is not None) == pytest.approx(
        phases["actual_total_time"], abs=1e-6
    )
    assert data["attributes"]["process_start"]["glowplug.clock_resolution_s"] == pytest.approx(
        1 / os.sysconf("SC_CLK_TCK")
    )
    assert data["global_provider_installed"] is True


def test_create_time_agrees_with_psutil_and_is_in_the_past() -> None:
    created = process_create_time()
    # psutil adds a whole-second boot time, so it may be off by up to a second.
    assert created.wall_ns / 1e9 == pytest.approx(psutil.Process().create_time(), abs=1.05)
    assert created.wall_ns < time.time_ns()
    if sys.platform.startswith("linux"):
        assert created.method == "proc_stat_boottime" and created.resolution_s == 1 / os.sysconf("SC_CLK_TCK")


def test_marks_are_ordered_and_imports_mark_is_sticky() -> None:
    marks = mark_main_entry()
    assert marks.process_start_ns <= marks.main_entry_ns
    first = marks.mark_imports_done()
    time.sleep(0.001)
    assert marks.mark_imports_done() == first >= marks.main_entry_ns
    assert marks.pid == os.getpid()
