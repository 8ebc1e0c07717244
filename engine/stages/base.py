"""The start-up stage protocol and the runner that turns every stage into one timed span.

A stage does its work and returns a StageReport; it never times itself. `run_stages` opens
`glowplug.startup.<stage>` around each one, so the span is the single record the phase table, the logs and the
server's `/startup` read. Adding, skipping or reordering phases is an edit of the list passed in.

Overlap: a stage may declare `needs` and `provides` (names of context slots). A stage then waits only for the
latest earlier stages that provide what it needs (and for the latest earlier stage that provides a slot it also
provides, so two writers of one slot keep their list order); independent stages run at the same time, each on its
own thread, with the OpenTelemetry context (and every other contextvar) copied in so its span still hangs off the
start-up span. A stage without declarations is a barrier: it waits for everything before it and everything after
it waits for it, which is the plain sequential pipeline.

Failure: the first stage in pipeline order among those that failed is the one reported (so two stages failing at
once always give the same answer); no stage starts after a failure, and the ones already running are joined
before `StartupFailed` is raised, so no thread outlives the start-up.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, Status, StatusCode, Tracer

from glowplug.base.errors import one_line
from glowplug.profiling.names import SCHEMA_VERSION, STAGE_ROWS, STARTUP_SPAN, Attr, stage_span_name
from glowplug.profiling.process import Clock

# What OpenTelemetry accepts as an attribute value (homogeneous sequences only).
AttrValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]

T = TypeVar("T")


@dataclass
class StageReport:
    """What a stage tells the runner; everything here ends up on the stage's span.

    skipped_reason: the stage ran but had nothing to do ("skipped: no CUDA", "cache hit", "--compile off"); its
        table row then shows no time and this reason.
    row: the table row to book the time to when it is not the stage's default, e.g. graph_compile reports
        "graph_compile_cached" on a cache hit and "graph_compile_general_shape" on a miss.
    """

    attributes: dict[str, AttrValue] = field(default_factory=dict)
    skipped_reason: str | None = None
    row: str | None = None

    @classmethod
    def skipped(cls, reason: str, attributes: Mapping[str, AttrValue] | None = None) -> StageReport:
        """`StageReport.skipped("skipped: no CUDA")`."""
        return cls(attributes=dict(attributes or {}), skipped_reason=reason)


@dataclass
class StartupContext:
    """State the stages share: the config plus named slots the stages fill (tokenizer, model, kv cache, ...).

    The engine may subclass this with typed fields; `state` keeps the runner independent of what those are.
    """

    config: Any
    state: dict[str, Any] = field(default_factory=dict)

    def put(self, key: str, value: Any) -> None:
        self.state[key] = value

    def require(self, key: str, kind: type[T] | None = None) -> T:
        """The value an earlier stage stored under `key`; a clear error when the pipeline order is wrong."""
        if key not in self.state:
            have = ", ".join(sorted(self.state)) or "nothing"
            raise KeyError(f"no {key!r} in the start-up context (have: {have}); is the stage that makes it earlier?")
        value = self.state[key]
        if kind is not None and not isinstance(value, kind):
            raise TypeError(f"start-up context {key!r} is {type(value).__name__}, expected {kind.__name__}")
        return value  # type: ignore[no-any-return]


@runtime_checkable
class Stage(Protocol):
    """One start-up phase. `name` is the span-name suffix and (unless the report overrides it) the table row."""

    name: str

    def run(self, ctx: StartupContext) -> StageReport: ...


def stage_needs(stage: Stage) -> tuple[str, ...] | None:
    """The context slots `stage` reads, or None when it does not say (then it runs as a barrier)."""
    needs = getattr(stage, "needs", None)
    return None if needs is None else tuple(needs)


def stage_provides(stage: Stage) -> tuple[str, ...]:
    return tuple(getattr(stage, "provides", ()) or ())


def stage_dependencies(stages: Sequence[Stage]) -> dict[str, tuple[str, ...]]:
    """stage name -> the names of the earlier stages it must wait for (see the module docstring)."""
    deps: dict[str, tuple[str, ...]] = {}
    last_provider: dict[str, str] = {}
    barrier: str | None = None
    since_barrier: list[str] = []
    for stage in stages:
        needs = stage_needs(stage)
        if needs is None:
            wait = list(since_barrier) if since_barrier else ([barrier] if barrier else [])
            deps[stage.name] = tuple(wait)
            barrier, since_barrier = stage.name, []
            last_provider = {}
            continue
        wanted = [last_provider[slot] for slot in (*needs, *stage_provides(stage)) if slot in last_provider]
        if barrier is not None:
            wanted.append(barrier)
        deps[stage.name] = tuple(dict.fromkeys(wanted))
        for slot in stage_provides(stage):
            last_provider[slot] = stage.name
        since_barrier.append(stage.name)
    return deps


@dataclass(frozen=True)
class StageResult:
    name: str
    row: str
    seconds: float
    report: StageReport
    span_context: SpanContext
    start_ns: int = 0  # perf_counter_ns at the stage's start and end (critical path, overlap)
    end_ns: int = 0
    thread: str = ""


class StartupFailed(RuntimeError):
    """A stage raised; `stage` names it and `cause` is the original exception (also `__cause__`)."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        self.stage = stage
        self.cause = cause
        self.reason = one_line(cause)
        super().__init__(f"start-up failed in {stage}: {self.reason}")


def _check_names(stages: Sequence[Stage]) -> None:
    # Duplicates would book two spans to one row and make "which one failed" ambiguous.
    seen: set[str] = set()
    for stage in stages:
        name = getattr(stage, "name", None)
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"stage {stage!r} needs a non-empty `name` without dots (got {name!r})")
        if name in seen:
            raise ValueError(f"stage {name!r} appears twice in the pipeline")
        seen.add(name)


def _run_one(
    stage: Stage, ctx: StartupContext, tracer: Tracer, parent: Span, clock: Clock, waits_for: Sequence[str] = ()
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
        attributes={Attr.STAGE: stage.name, Attr.WAITS_FOR: list(waits_for), Attr.THREAD_NAME: thread.name,
                    Attr.THREAD_ID: thread.native_id or 0},  # fmt: skip
    )
    # Current for the stage's duration so the stage's own log lines and child spans hang off it.
    with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
        try:
            report = stage.run(ctx)
            if not isinstance(report, StageReport) or not isinstance(report.attributes, Mapping):
                raise TypeError(f"{type(stage).__name__}.run returned {report!r:.200}, not a StageReport")
        except BaseException as exc:
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
    return StageResult(name=stage.name, row=row, seconds=seconds, report=report, span_context=span.get_span_context(),
                       start_ns=t0, end_ns=t1, thread=thread.name)  # fmt: skip


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
    Raises StartupFailed when a stage raises; that stage's span has status ERROR and the exception event.
    """
    _check_names(stages)
    clock = clock or Clock()
    own_root = parent is None
    root = (
        tracer.start_span(STARTUP_SPAN, start_time=clock.now_ns(), attributes={Attr.SCHEMA_VERSION: SCHEMA_VERSION})
        if parent is None
        else parent
    )
    root.set_attribute(Attr.THREAD_NAME, threading.current_thread().name)
    try:
        results = _schedule(stages, ctx, tracer, root, clock, on_phase)
    except StartupFailed as failed:
        if own_root:
            root.set_status(Status(StatusCode.ERROR, str(failed)))
            root.set_attribute(Attr.ERROR, str(failed))
        raise
    finally:
        if own_root:
            root.end(end_time=clock.now_ns())
    return results


_Outcome = tuple[str, "StageResult | BaseException"]


def _schedule(
    stages: Sequence[Stage],
    ctx: StartupContext,
    tracer: Tracer,
    root: Span,
    clock: Clock,
    on_phase: Callable[[str], None] | None,
) -> list[StageResult]:
    """Start every stage whose dependencies are done; one of the ready stages runs on this thread (a sequential
    pipeline then never leaves it, and Ctrl-C lands where it always did), the others on threads of their own."""
    deps = stage_dependencies(stages)
    pending = list(stages)
    done: dict[str, StageResult] = {}
    errors: dict[str, BaseException] = {}
    finished: queue.Queue[_Outcome] = queue.Queue()
    threads: dict[str, threading.Thread] = {}

    def run(stage: Stage) -> StageResult:
        if on_phase is not None:
            on_phase(stage.name)
        return _run_one(stage, ctx, tracer, root, clock, deps[stage.name])

    def on_thread(stage: Stage) -> None:
        try:
            finished.put((stage.name, run(stage)))
        except BaseException as exc:  # noqa: BLE001 - handed to the scheduling thread, which re-raises it
            finished.put((stage.name, exc))

    def collect(outcome: _Outcome) -> None:
        name, value = outcome
        threads.pop(name, None)
        if isinstance(value, BaseException):
            errors[name] = value
        else:
            done[name] = value

    try:
        while pending and not errors:
            ready = [s for s in pending if all(d in done for d in deps[s.name])]
            if not ready:
                collect(finished.get())  # something is running (the dependencies are acyclic by construction)
                continue
            inline, *others = ready
            for stage in others:
                pending.remove(stage)
                # A copy of this thread's contextvars: the OpenTelemetry context, structlog's bound fields.
                context = contextvars.copy_context()
                thread = threading.Thread(target=context.run, args=(on_thread, stage),
                                          name=f"glowplug-stage-{stage.name}", daemon=True)  # fmt: skip
                threads[stage.name] = thread
                thread.start()
            pending.remove(inline)
            try:
                done[inline.name] = run(inline)
            except BaseException as exc:  # noqa: BLE001 - decided below, after the other stages are joined
                errors[inline.name] = exc
            while True:  # take what the other threads finished meanwhile without blocking
                try:
                    collect(finished.get_nowait())
                except queue.Empty:
                    break
    finally:
        # Join every running stage before anything is raised: a stage must not keep writing into the context of
        # a start-up that is already reported as failed (or interrupted).
        while threads:
            collect(finished.get())
    if errors:
        order = [s.name for s in stages]
        first = min(errors, key=order.index)
        raise errors[first]
    return [done[s.name] for s in stages]
