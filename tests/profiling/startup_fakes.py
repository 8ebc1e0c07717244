"""Fake start-up stages: real Stage implementations that sleep instead of loading a model.

A SleepStage is an explicit barrier by default (the fakes then run one after another, the plain sequential
pipeline); one that declares slots and sets `barrier=False` is scheduled by them, over a FakeContext."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry import trace

from glowplug.engine.stages.protocol import AttrValue, StageReport, StartupContext
from glowplug.profiling.names import Attr


@dataclass
class FakeContext(StartupContext):
    """The slots the fakes declare (the real stages' names, untyped)."""

    config: Any = None
    model_dir: Any = None
    tokenizer: Any = None
    state_dict: Any = None
    model: Any = None
    engine: Any = None
    other: Any = None


@dataclass
class SleepStage:
    name: str
    seconds: float = 0.005
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    skipped_reason: str | None = None
    row: str | None = None
    error: BaseException | None = None
    log_inside: bool = False
    returns: Any = "report"
    events: list[tuple[str, str]] | None = None  # shared call log: ("run", name)
    seen_span: trace.SpanContext | None = None
    busy: bool = False  # spin instead of sleeping, like a CPU-bound stage
    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()
    barrier: bool = True

    def run(self, ctx: StartupContext) -> StageReport:
        if self.events is not None:
            self.events.append(("run", self.name))
        self.seen_span = trace.get_current_span().get_span_context()
        if self.log_inside:
            structlog.get_logger("test").info("inside stage", stage=self.name)
        if self.busy:
            deadline = time.perf_counter() + self.seconds
            while time.perf_counter() < deadline:
                pass
        else:
            time.sleep(self.seconds)
        for slot in self.provides:
            setattr(ctx, slot, self.name)
        if self.error is not None:
            raise self.error
        if self.returns != "report":
            return self.returns  # type: ignore[no-any-return]
        return StageReport(attributes=dict(self.attributes), skipped_reason=self.skipped_reason, row=self.row)


def default_pipeline(seconds: float = 0.005, *, busy: bool = False) -> list[SleepStage]:
    """One fake per default stage, with the attributes the real ones report."""
    stages = [
        SleepStage("model_prepare", seconds, {Attr.CACHE_HIT: True}),
        SleepStage("tokenizer_init", seconds),
        SleepStage("grammar_init", seconds, {Attr.VOCAB_SIZE: 49152, Attr.ROW_NOTE: "not cached"}),
        SleepStage("load_weights", seconds, {Attr.BYTES_READ: 1 << 20, Attr.READ_GBPS: 1.5, Attr.DTYPE: "bfloat16"}),
        SleepStage("model_init", seconds, {Attr.PARAM_COUNT: 135_000_000}),
        SleepStage("quantize_weights", seconds, {Attr.QUANTIZATION: "int8"}),
        SleepStage("native_kernels", seconds, {Attr.CACHE_HIT: True}),
        SleepStage("dynamo_transform", seconds),
        SleepStage(
            "graph_compile",
            seconds,
            {Attr.CACHE_HIT: False, Attr.CACHE_KEY: "abc123", Attr.CACHE_MISS_REASON: "empty cache"},
            row="graph_compile_general_shape",
        ),
        SleepStage("kv_cache_profiling", seconds, {Attr.PEAK_MEMORY_BYTES: 1 << 30}),
        SleepStage("kv_cache_init", seconds, {Attr.KV_BLOCKS: 512, Attr.KV_TOKEN_CAPACITY: 8192}),
        SleepStage("graph_capture", 0.0, skipped_reason="skipped: no CUDA"),
        SleepStage("warmup", seconds, {Attr.GRAPH_SIZES: [1, 2, 4], Attr.GRAPH_SIZE_TIMES_S: [0.01, 0.02, 0.03]}),
    ]
    for stage in stages:
        stage.busy = busy
    return stages


def run_startup(tracing: Any, stages: list[Any], *, imports_s: float = 0.0) -> tuple[Any, float, int]:
    """Run a start-up the way the engine does (process marks, root span, the stage runner, READY): returns (phase
    table, wall seconds of run_stages, ready ns). `imports_s` sleeps first, standing in for the heavy imports."""
    from glowplug.engine.stages.runner import run_stages
    from glowplug.profiling.phases import build_phase_table
    from glowplug.profiling.process import mark_main_entry, open_startup_span

    marks = mark_main_entry()
    if imports_s:
        time.sleep(imports_s)
    tracer = tracing.tracer()
    root = open_startup_span(tracer, marks)
    t0 = time.perf_counter()
    try:
        run_stages(stages, FakeContext(), tracer=tracer, parent=root, clock=marks.clock)
    finally:
        wall = time.perf_counter() - t0
        ready = marks.clock.now_ns()
        root.end(end_time=ready)
    return build_phase_table(tracing.finished_spans(), ready_time_ns=ready), wall, ready
