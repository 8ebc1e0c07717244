"""The span runner: every stage of a pipeline becomes one timed `glowplug.startup.<stage>` span.

Planted delays (a test hook, off by default): GLOWPLUG_TEST_STAGE_DELAY="stage=seconds[,stage=seconds]" makes the
runner sleep that long inside the named stage's span before running it, and says so on the span
(`glowplug.test_delay_s`). The start-up regression gate's test plants a regression with it; nothing else sets it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, cast

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from glowplug.base.errors import one_line
from glowplug.profiling.names import SCHEMA_VERSION, STAGE_ROWS, STARTUP_SPAN, Attr, stage_span_name
from glowplug.profiling.process import Clock

from .protocol import (
    Stage,
    StageContractError,
    StageReport,
    StageResult,
    StartupContext,
    StartupFailed,
    check_pipeline,
    declarations,
)
from .schedule import plan_concurrency, run_scheduled
from .view import ContextView

STAGE_DELAY_ENV: Final = "GLOWPLUG_TEST_STAGE_DELAY"


def planted_delay(stage: str) -> float:
    """Seconds GLOWPLUG_TEST_STAGE_DELAY plants in `stage` (module docstring), 0 when unset; a malformed value is an
    error naming the variable, since a test that plants nothing would pass for the wrong reason."""
    spec = os.environ.get(STAGE_DELAY_ENV, "").strip()
    if not spec:
        return 0.0
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not sep or seconds < 0:
            raise ValueError(f"{STAGE_DELAY_ENV}={spec!r}: write stage=seconds[,stage=seconds], e.g. warmup=0.5")
        if name.strip() == stage:
            return seconds
    return 0.0


def _run_one(
    stage: Stage,
    ctx: StartupContext,
    tracer: Tracer,
    parent: Span,
    clock: Clock,
    waits_for: Sequence[str] = (),
    scheduling: str | None = None,
) -> StageResult:
    log = structlog.get_logger("glowplug.startup")
    span_name = stage_span_name(stage.name)
    thread = threading.current_thread()
    t0 = time.perf_counter_ns()
    span = tracer.start_span(
        span_name,
        context=trace.set_span_in_context(parent),
        start_time=clock.wall_ns(t0),
        # The waited-for stages let the phase table find the critical path from the spans alone; the thread lets
        # a trace viewer draw one lane per thread.
        attributes={
            Attr.STAGE: stage.name,
            Attr.WAITS_FOR: list(waits_for),
            Attr.THREAD_NAME: thread.name,
            Attr.THREAD_ID: thread.native_id or 0,
        },
    )
    if scheduling is not None:
        span.set_attribute(Attr.SCHEDULING, scheduling)
    needs, provides = declarations(stage)
    view = ContextView(ctx, stage.name, needs, provides)
    # Current for the stage's duration so the stage's own log lines and child spans hang off it.
    with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
        try:
            delay = planted_delay(stage.name)
            if delay:
                span.set_attribute(Attr.TEST_DELAY_S, delay)
                time.sleep(delay)
            # The view stands in for the context: it has the same attributes, under the stage's contract.
            report = stage.run(cast(StartupContext, view))
            if view._violations:  # the stage caught the error (a broad `except Exception` fallback): still a bug
                raise StageContractError(view._violations[0])
            if not isinstance(report, StageReport) or not isinstance(report.attributes, Mapping):
                raise TypeError(f"{type(stage).__name__}.run returned {report!r:.200}, not a StageReport")
        except BaseException as exc:
            view._close()
            if isinstance(exc, Exception) and view._violations and not isinstance(exc, StageContractError):
                # The stage caught a violation and failed further on: the violation is what to report and fix.
                contract = StageContractError(view._violations[0])
                contract.__context__ = exc
                exc = contract
            t1 = time.perf_counter_ns()
            reason = one_line(exc)
            span.record_exception(exc, escaped=True)
            span.set_attribute(Attr.ERROR, reason)
            span.set_status(Status(StatusCode.ERROR, reason))
            span.end(end_time=clock.wall_ns(t1))
            log.error(span_name, stage=stage.name, duration_s=(t1 - t0) / 1e9, error=reason)
            if isinstance(exc, Exception):
                raise StartupFailed(stage.name, exc) from exc
            raise  # KeyboardInterrupt / SystemExit stay what they are; the span already says where they hit
        t1 = time.perf_counter_ns()
        view._close()
        row = report.row or STAGE_ROWS.get(stage.name, stage.name)
        span.set_attributes(report.attributes)
        if report.skipped_reason is not None:
            span.set_attribute(Attr.SKIPPED_REASON, report.skipped_reason)
        if report.row is not None:
            span.set_attribute(Attr.ROW, report.row)
        span.end(end_time=clock.wall_ns(t1))
        seconds = (t1 - t0) / 1e9
        # The span's attribute keys double as log fields; the runner's own fields win a (silly) name clash.
        fields: dict[str, Any] = {k: v for k, v in report.attributes.items() if k != "event"}
        fields.update(stage=stage.name, row=row, duration_s=seconds)
        if report.skipped_reason is not None:
            fields[Attr.SKIPPED_REASON] = report.skipped_reason
        log.info(span_name, **fields)
    return StageResult(
        name=stage.name,
        row=row,
        seconds=seconds,
        report=report,
        span_context=span.get_span_context(),
        start_ns=t0,
        end_ns=t1,
        thread=thread.name,
        reads=frozenset(view._reads),
        writes=frozenset(view._writes),
    )


def run_stages(
    stages: Sequence[Stage],
    ctx: StartupContext,
    *,
    tracer: Tracer,
    on_phase: Callable[[str], None] | None = None,
    parent: Span | None = None,
    clock: Clock | None = None,
) -> list[StageResult]:
    """Run `stages` (concurrently where their declarations allow), one child span each; results in list order.

    parent: an already-open span to hang the stages under (e.g. from `open_startup_span`); the caller ends it.
        Without one, a `glowplug.startup` span is opened and ended here.
    clock: pass `ProcessMarks.clock` so stage spans share a time line with the pre-main spans.
    on_phase: called with each stage's name just before it runs (the server shows the current phase); from the
        thread that runs the stage.
    Raises StartupFailed when a stage raises (a contract violation included: StageContractError as its cause);
    that stage's span has status ERROR and the exception event. Raises StageContractError before anything runs
    when a declaration is missing or names no slot of `ctx` (see check_pipeline).
    """
    check_pipeline(stages, type(ctx))
    concurrency = plan_concurrency(stages, ctx.config)  # before the root span: a bad declaration opens nothing
    clock = clock or Clock()
    own_root = parent is None
    root = (
        tracer.start_span(STARTUP_SPAN, start_time=clock.now_ns(), attributes={Attr.SCHEMA_VERSION: SCHEMA_VERSION})
        if parent is None
        else parent
    )
    root.set_attribute(Attr.THREAD_NAME, threading.current_thread().name)
    root.set_attributes({Attr.STAGE_CONCURRENCY: concurrency.reason, Attr.USABLE_CORES: concurrency.cores})
    try:

        def run_one(stage: Stage, waits_for: tuple[str, ...], scheduling: str | None) -> StageResult:
            if on_phase is not None:
                on_phase(stage.name)
            return _run_one(stage, ctx, tracer, root, clock, waits_for, scheduling)

        results = run_scheduled(stages, concurrency, run_one)
    except StartupFailed as failed:
        if own_root:
            root.set_status(Status(StatusCode.ERROR, str(failed)))
            root.set_attribute(Attr.ERROR, str(failed))
        raise
    finally:
        if own_root:
            root.end(end_time=clock.now_ns())
    return results


def run_in_order(hooks: Sequence[Stage], ctx: StartupContext) -> list[StageReport]:
    """Run `hooks` one after another on this thread, each under its contract (a ContextView of `ctx`), without a
    span of its own: for work around the pipeline that is no phase of the start (engine/stages/ready.py). An
    exception propagates as it is; a contract violation raises StageContractError even when the hook caught it."""
    check_pipeline(hooks, type(ctx))
    reports: list[StageReport] = []
    for hook in hooks:
        needs, provides = declarations(hook)
        view = ContextView(ctx, hook.name, needs, provides)
        try:
            report = hook.run(cast(StartupContext, view))
        finally:
            view._close()
        if view._violations:
            raise StageContractError(view._violations[0])
        reports.append(report)
    return reports
