"""The pre-main part of start-up: OS process creation -> first line of our code -> heavy imports done.

These phases end before any tracer exists, so they are captured as timestamps and turned into real spans (explicit
start/end times) once tracing is set up; the phase table is then still built from spans only.

Clocks: spans carry wall-clock ns, but durations must come from a monotonic clock. `Clock` maps
`time.perf_counter_ns()` onto the wall clock through one anchor taken once, so every span recorded through the same
Clock has exact perf_counter durations and no gaps or overlaps from wall-clock steps.

Process creation time: `/proc/self/stat` gives the start in clock ticks since boot. psutil adds that to the boot
time from `/proc/stat`, which is whole seconds, so its answer can be ~1 s off. Here the process *age* is taken
against CLOCK_BOOTTIME (the clock starttime is counted on), then subtracted from now: the error is one tick (10 ms
at USER_HZ=100), recorded on the span as `glowplug.clock_resolution_s`.

Only the standard library is imported at module level: the CLI imports this before anything heavy.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from glowplug.profiling.names import IMPORTS, PROCESS_START, SCHEMA_VERSION, STARTUP_SPAN, Attr, stage_span_name

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer


@dataclass(frozen=True)
class Clock:
    """perf_counter_ns mapped onto the wall clock through one anchor (see the module docstring)."""

    anchor_wall_ns: int = field(default_factory=time.time_ns)
    anchor_perf_ns: int = field(default_factory=time.perf_counter_ns)

    def wall_ns(self, perf_ns: int) -> int:
        """The wall-clock time (ns since the epoch) of a `time.perf_counter_ns()` reading."""
        return self.anchor_wall_ns + (perf_ns - self.anchor_perf_ns)

    def now_ns(self) -> int:
        return self.wall_ns(time.perf_counter_ns())


@dataclass(frozen=True)
class CreateTime:
    wall_ns: int
    resolution_s: float
    method: str


def _proc_stat_create_time(clock: Clock, pid: int) -> CreateTime:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        stat = f.read()
    # comm (field 2) may contain spaces and parentheses; everything after the last ')' is space separated,
    # starting at field 3, so starttime (field 22) is index 19.
    start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    hz = os.sysconf("SC_CLK_TCK")
    # Read both clocks back to back so the age and "now" refer to the same instant.
    boot_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    now_wall = clock.now_ns()
    age_ns = boot_ns - start_ticks * 1_000_000_000 // hz
    return CreateTime(wall_ns=now_wall - age_ns, resolution_s=1.0 / hz, method="proc_stat_boottime")


def process_create_time(pid: int | None = None, *, clock: Clock | None = None) -> CreateTime:
    """When the OS created the process, as wall-clock ns on `clock`'s time line."""
    clock = clock or Clock()
    pid = os.getpid() if pid is None else pid
    if sys.platform.startswith("linux"):
        try:
            return _proc_stat_create_time(clock, pid)
        except (OSError, ValueError, IndexError, AttributeError):
            pass  # hardened /proc or an unusual kernel: psutil still knows, only less precisely
    import psutil

    # psutil's resolution on Linux is bounded by the whole-second boot time; elsewhere it is the OS's own.
    return CreateTime(wall_ns=int(psutil.Process(pid).create_time() * 1e9), resolution_s=1.0, method="psutil")


# Gen-1 collections before a full one while start-up defers them: more than any start makes.
DEFERRED_FULL_GC = 1_000_000


@dataclass
class FullGcDeferral:
    """Python's full (oldest-generation) garbage collections deferred until `resume()`; young ones keep running.

    Why: a start creates about 650k long-lived objects (torch, Dynamo's and Inductor's runtime modules, the model),
    and every full collection walks all of them again (importing torch, Dynamo and Inductor's runtime alone triggers
    six), while the young collections that free start-up's short-lived cycles cost little. The warm start with the
    deferral: reports/startup/ (`glowplug bench startup`)."""

    saved: tuple[int, int, int] | None

    @classmethod
    def start(cls) -> FullGcDeferral:
        saved = gc.get_threshold()
        if saved[0] == 0:  # the embedding program turned automatic collection off: not ours to change
            return cls(None)
        gc.set_threshold(saved[0], saved[1], max(saved[2], DEFERRED_FULL_GC))
        return cls(saved)

    def resume(self, *, freeze: bool = False) -> None:
        """Restore the thresholds (idempotent). freeze: first move every object alive now out of all future
        collections (`gc.freeze`). Only for a process that built its one engine: otherwise the first full
        collection after READY would walk the whole start-up heap while requests wait. The price is start-up's
        uncollected cycles, pinned: gc.collect() at READY found 198 unreachable objects after a warm start of the
        default model and 96k after a cold one (Dynamo's and Inductor's compile-time garbage)."""
        if self.saved is None:
            return
        if freeze:
            gc.freeze()
        gc.set_threshold(*self.saved)
        self.saved = None


@dataclass
class ProcessMarks:
    """Timestamps of the pre-main phases; create it with `mark_main_entry()` and pass it along explicitly."""

    clock: Clock
    pid: int
    process_start_ns: int
    main_entry_ns: int
    resolution_s: float
    method: str
    imports_done_ns: int | None = None
    # Seconds `import torch` took in this process (the floor's import term), when the caller measured it.
    import_torch_s: float | None = None
    # Full collections deferred from entry to READY (defer_full_gc); build_engine resumes them.
    gc_deferral: FullGcDeferral | None = None

    def defer_full_gc(self) -> None:
        """For a process that starts one engine: defer full collections from now until READY, where build_engine
        resumes them and freezes what the start built (FullGcDeferral)."""
        if self.gc_deferral is None:
            self.gc_deferral = FullGcDeferral.start()

    def mark_imports_done(self) -> int:
        """Call once the heavy imports (torch, transformers, ...) are done; the first call wins."""
        if self.imports_done_ns is None:
            self.imports_done_ns = self.clock.now_ns()
        return self.imports_done_ns


def mark_main_entry() -> ProcessMarks:
    """Call on the first line of our code (the CLI's main, before heavy imports). Also takes the CPU sample that
    the start-up model's contention input is measured from (profiling/cpu_busy.py)."""
    from glowplug.profiling.cpu_busy import mark_entry

    mark_entry()
    clock = Clock()
    entry = clock.now_ns()
    created = process_create_time(clock=clock)
    # Tick truncation can only make the creation look earlier, never later; clamp anyway for odd /proc values.
    return ProcessMarks(
        clock=clock,
        pid=os.getpid(),
        process_start_ns=min(created.wall_ns, entry),
        main_entry_ns=entry,
        resolution_s=created.resolution_s,
        method=created.method,
    )


def record_pre_main_spans(tracer: Tracer, marks: ProcessMarks, *, context: Context | None = None) -> None:
    """Record `process_start` and `imports` as finished spans (children of `context`'s span, if any)."""
    imports_done = marks.mark_imports_done()
    process_span = tracer.start_span(
        stage_span_name(PROCESS_START),
        context=context,
        start_time=marks.process_start_ns,
        attributes={
            Attr.STAGE: PROCESS_START,
            Attr.PID: marks.pid,
            Attr.CLOCK_RESOLUTION_S: marks.resolution_s,
        },
    )
    process_span.end(end_time=marks.main_entry_ns)
    imports_span = tracer.start_span(
        stage_span_name(IMPORTS), context=context, start_time=marks.main_entry_ns, attributes={Attr.STAGE: IMPORTS}
    )
    imports_span.end(end_time=imports_done)


def open_startup_span(tracer: Tracer, marks: ProcessMarks) -> Span:
    """Open the root `glowplug.startup` span at process creation, with the pre-main spans already under it.

    The caller passes the returned span to `run_stages(..., parent=span, clock=marks.clock)` and ends it at READY
    (`span.end(end_time=marks.clock.now_ns())`), so the root span's duration is actual_total_time.
    """
    from opentelemetry import trace

    root = tracer.start_span(
        STARTUP_SPAN,
        start_time=marks.process_start_ns,
        attributes={Attr.SCHEMA_VERSION: SCHEMA_VERSION, Attr.PID: marks.pid},
    )
    record_pre_main_spans(tracer, marks, context=trace.set_span_in_context(root))
    return root
