"""The start-up stage protocol and the runner that turns every stage into one timed span.

A stage does its work and returns a StageReport; it never times itself. `run_stages` opens
`glowplug.startup.<stage>` around each one, so the span is the single record the phase table, the logs and the
server's `/startup` read. Adding, skipping or reordering phases is an edit of the list passed in.

Contracts: every stage declares `needs` (the context slots it reads) and `provides` (the slots it writes), and
gets a `ContextView` of the context instead of the context itself. The view lets the stage read only the slots it
needs (and those it has already written itself) plus the context's INPUTS, and write only the slots it provides;
anything else raises StageContractError naming the stage, the slot and its declarations. Methods of the context
are bound to the view, so they read under the same rules. The declared names are checked against the context's
fields before any stage runs, so a typo fails the pipeline at once.

Overlap: a stage waits only for the latest earlier stages that provide what it needs (and for the latest earlier
stage that provides a slot it also provides, so two writers of one slot keep their list order); independent
stages run at the same time, each on its own thread, with the OpenTelemetry context (and every other contextvar)
copied in so its span still hangs off the start-up span. The schedule comes from the declarations alone. A stage
that must run alone sets `barrier = True`: it waits for everything before it and everything after it waits for
it (its view still holds it to its declarations). No engine stage is one; test harnesses that pace a start-up one
stage at a time are.

Few cores: a stage whose `cpu_bound(config)` says it keeps every core busy (the Dynamo trace, the Inductor compile,
a measured KV profile) does not run beside another such stage when the process may use fewer than
`SERIAL_CPU_BOUND_BELOW_CORES` cores (`os.sched_getaffinity`): each then waits for the CPU-bound stage before it in
list order as well, so the overlap is never two stages sharing two cores. The decision and its reason are on the
start-up span (`glowplug.stage_concurrency`, `glowplug.usable_cores`) and, on each stage it delayed, which stage it
now waits for (`glowplug.scheduling`); the extra wait is in `glowplug.waits_for`, so the critical path includes it.

Planted delays (a test hook, off by default): GLOWPLUG_TEST_STAGE_DELAY="stage=seconds[,stage=seconds]" makes the
runner sleep that long inside the named stage's span before running it, and says so on the span
(`glowplug.test_delay_s`). The start-up regression gate's test plants a regression with it; nothing else sets it.

Failure: the first stage in pipeline order among those that failed is the one reported (so two stages failing at
once always give the same answer); no stage starts after a failure, and the ones already running are joined
before `StartupFailed` is raised, so no thread outlives the start-up.
"""

from __future__ import annotations

import contextvars
import difflib
import inspect
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, ClassVar, Final, Protocol, cast, runtime_checkable

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span, SpanContext, Status, StatusCode, Tracer

from glowplug.base.errors import one_line
from glowplug.profiling.names import SCHEMA_VERSION, STAGE_ROWS, STARTUP_SPAN, Attr, stage_span_name
from glowplug.profiling.process import Clock

# What OpenTelemetry accepts as an attribute value (homogeneous sequences only).
AttrValue = str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]


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


class StageContractError(RuntimeError):
    """A stage declared, read or wrote a context slot against its contract (see the module docstring)."""


@dataclass
class StartupContext:
    """State the stages share. The engine subclasses this with typed fields; every field is either an input or a
    slot.

    INPUTS: the fields set before the first stage runs (the config, and in subclasses such things as the cache
        folder and the device). Every stage may read them without declaring them; no stage may write them.
    Slots: every other field. A stage reads a slot only when it declares it in `needs`, and writes it only when it
        declares it in `provides`.
    """

    INPUTS: ClassVar[frozenset[str]] = frozenset({"config"})

    config: Any

    @classmethod
    def slot_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclass_fields(cls)) - cls.INPUTS


@runtime_checkable
class Stage(Protocol):
    """One start-up phase. `name` is the span-name suffix and (unless the report overrides it) the table row.

    needs: the context slots `run` reads (written by earlier stages); `()` for none.
    provides: the context slots `run` writes; `()` for none. A stage that does its work (its report is not
        skipped) writes each of them, unless a comment at the declaration names the path that writes it; one that
        changes a slot's object in place stores it back, so the write is what the contract and the schedule see.
    An optional `barrier = True` makes the stage run alone (see the module docstring).
    An optional `cpu_bound(config) -> bool` says the stage keeps every core busy under that config; with few cores
    such stages run one at a time (see the module docstring).
    `run` gets a ContextView of the context, which has the context's attributes.
    """

    name: str
    needs: tuple[str, ...]
    provides: tuple[str, ...]

    def run(self, ctx: Any) -> StageReport: ...


def declarations(stage: Stage) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(needs, provides) of `stage`; StageContractError when it does not declare both as slot-name tuples."""
    declared: list[tuple[str, ...]] = []
    for kind in ("needs", "provides"):
        value = getattr(stage, kind, None)
        if value is None:
            raise StageContractError(f"stage {stage.name!r} declares no `{kind}`: every stage declares the context "
                                     f"slots it reads (needs) and writes (provides), `()` for none")  # fmt: skip
        if isinstance(value, str) or not all(isinstance(slot, str) for slot in value):
            raise StageContractError(f"stage {stage.name!r}: `{kind}` must be a tuple of slot names, not {value!r}")
        declared.append(tuple(value))
    return declared[0], declared[1]


def is_barrier(stage: Stage) -> bool:
    barrier = getattr(stage, "barrier", False)
    if not isinstance(barrier, bool):
        raise StageContractError(f"stage {stage.name!r}: `barrier` must be True or False, not {barrier!r}")
    return barrier


# Below this many usable cores, CPU-bound stages run one after another instead of side by side. 2, so only a single
# core serializes them: there, two such stages can only share it. On the 2-core AMD EPYC, cold default-model starts
# with a measured KV profile beside the compile were not slower than with it after the compile (READY minus the
# load_weights row, which disk stalls from other jobs inflated: median 36.7 s overlapped vs 44.5 s one after the
# other over 6 interleaved pairs; the quietest pair 16.3 s vs 18.5 s): the compile leaves part of the second core
# idle (Dynamo and Inductor's code generation are single-threaded Python), which the profile's forward fills.
SERIAL_CPU_BOUND_BELOW_CORES: Final = 2
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


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container's cpuset narrows), else the CPU
    count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def is_cpu_bound(stage: Stage, config: Any) -> bool:
    """The stage's `cpu_bound(config)` where it declares one; False otherwise."""
    probe = getattr(stage, "cpu_bound", None)
    if probe is None:
        return False
    verdict = probe(config)
    if not isinstance(verdict, bool):
        raise StageContractError(f"stage {stage.name!r}: `cpu_bound(config)` must return True or False, not "
                                 f"{verdict!r}")  # fmt: skip
    return verdict


@dataclass(frozen=True)
class Concurrency:
    """Whether CPU-bound stages may run side by side on this machine, and why (see the module docstring).

    serial: the CPU-bound stages, in list order, that run one after another (empty when they may overlap).
    """

    cores: int
    serial: tuple[str, ...]
    reason: str


def plan_concurrency(stages: Sequence[Stage], config: Any, cores: int | None = None) -> Concurrency:
    """The decision for this pipeline under `config` on `cores` usable cores (default: this process's)."""
    cores = usable_cores() if cores is None else cores
    heavy = tuple(s.name for s in stages if is_cpu_bound(s, config))
    have = f"{cores} usable core{'' if cores == 1 else 's'}"
    if cores >= SERIAL_CPU_BOUND_BELOW_CORES:
        return Concurrency(cores, (), f"{have}: CPU-bound stages may run side by side")
    if len(heavy) < 2:
        return Concurrency(cores, (), f"{have}: at most one CPU-bound stage ({_names(heavy)})")
    return Concurrency(cores, heavy, f"{have} (under {SERIAL_CPU_BOUND_BELOW_CORES}): CPU-bound "
                                     f"stages run one after another ({' -> '.join(heavy)})")  # fmt: skip


def check_pipeline(stages: Sequence[Stage], context_type: type[StartupContext]) -> None:
    """Before anything runs: unique names, and every stage's declarations naming slots of `context_type`."""
    _check_names(stages)
    slots = context_type.slot_names()
    for stage in stages:
        is_barrier(stage)
        for kind, declared in zip(("needs", "provides"), declarations(stage), strict=True):
            for slot in declared:
                if slot in context_type.INPUTS:
                    raise StageContractError(
                        f"stage {stage.name!r} declares {slot!r} in {kind}, but it is an input: every stage reads "
                        f"the inputs ({_names(context_type.INPUTS)}) without declaring them, and none writes them")
                if slot not in slots:
                    close = difflib.get_close_matches(slot, sorted(slots), n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else ""
                    raise StageContractError(
                        f"stage {stage.name!r} declares {slot!r} in {kind}, which is not a slot of "
                        f"{context_type.__name__}{hint} (slots: {_names(slots)})")


def _names(names: Sequence[str] | frozenset[str]) -> str:
    return ", ".join(sorted(names) if isinstance(names, frozenset) else names) or "none"


def stage_dependencies(stages: Sequence[Stage], serial: Sequence[str] = ()) -> dict[str, tuple[str, ...]]:
    """stage name -> the names of the earlier stages it must wait for (see the module docstring).

    serial: stages that run one after another (Concurrency.serial): each also waits for the one before it there."""
    deps: dict[str, tuple[str, ...]] = {}
    previous_serial: str | None = None
    last_provider: dict[str, str] = {}
    barrier: str | None = None
    since_barrier: list[str] = []
    for stage in stages:
        needs, provides = declarations(stage)
        if is_barrier(stage):
            wait = list(since_barrier) if since_barrier else ([barrier] if barrier else [])
            deps[stage.name] = tuple(wait)
            barrier, since_barrier = stage.name, []
            last_provider = {}
            continue
        wanted = [last_provider[slot] for slot in (*needs, *provides) if slot in last_provider]
        if barrier is not None:
            wanted.append(barrier)
        if stage.name in serial:
            if previous_serial is not None:
                wanted.append(previous_serial)
            previous_serial = stage.name
        deps[stage.name] = tuple(dict.fromkeys(wanted))
        for slot in provides:
            last_provider[slot] = stage.name
        since_barrier.append(stage.name)
    return deps


class ContextView:
    """What a stage's `run` gets instead of the context: the context's attributes, under the stage's contract.

    Reading a slot needs it in `needs` (or that this stage wrote it already: its own output); writing one needs it
    in `provides`; the context's INPUTS are readable by all and writable by none. Methods and properties of the
    context run bound to the view, so what they read is checked too. Every violation raises StageContractError and
    is also kept, so the runner fails the stage even when its code caught the error. `reads` (slots read from
    earlier stages) and `writes` are recorded for the StageResult. After the stage the view is closed: it lets go
    of the context, and a reference that outlived the stage fails loudly instead of keeping the context alive.
    """

    __slots__ = ("_ctx", "_stage", "_needs", "_provides", "_slots", "_inputs", "_reads", "_writes", "_violations")

    def __init__(self, ctx: StartupContext, stage: str, needs: tuple[str, ...], provides: tuple[str, ...]) -> None:
        init = object.__setattr__  # this class's own __setattr__ is the context's write path
        init(self, "_ctx", ctx)
        init(self, "_stage", stage)
        init(self, "_needs", needs)
        init(self, "_provides", provides)
        init(self, "_slots", type(ctx).slot_names())
        init(self, "_inputs", type(ctx).INPUTS)
        init(self, "_reads", set())
        init(self, "_writes", set())
        init(self, "_violations", [])

    def _context(self, name: str) -> StartupContext:
        if self._ctx is None:
            raise StageContractError(f"stage {self._stage!r}'s view of the start-up context was used for {name!r} "
                                     f"after the stage ended; keep the values, not the context")  # fmt: skip
        return cast(StartupContext, self._ctx)

    def _violate(self, message: str) -> StageContractError:
        self._violations.append(message)
        return StageContractError(message)

    def __getattr__(self, name: str) -> Any:
        ctx = self._context(name)
        if name in self._slots:
            if name not in self._writes:
                if name not in self._needs:
                    raise self._violate(f"stage {self._stage!r} read {name!r}, which it does not declare in needs "
                                        f"(needs: {_names(self._needs)})")  # fmt: skip
                self._reads.add(name)
            return getattr(ctx, name)
        if name in self._inputs:
            return getattr(ctx, name)
        try:
            attr = inspect.getattr_static(type(ctx), name)
        except AttributeError:
            raise AttributeError(f"{type(ctx).__name__} has no attribute {name!r}") from None
        # Bound to the view, not the context: a method reads slots under the stage's contract (no back door).
        bind = getattr(type(attr), "__get__", None)
        return bind(attr, self, type(ctx)) if bind is not None else attr

    def __setattr__(self, name: str, value: Any) -> None:
        ctx = self._context(name)
        if name in self._inputs:
            raise self._violate(f"stage {self._stage!r} wrote {name!r}, an input of the start-up: inputs are "
                                f"read-only")  # fmt: skip
        if name not in self._slots:
            raise self._violate(f"stage {self._stage!r} wrote {name!r}, which is not a slot of "
                                f"{type(ctx).__name__} (slots: {_names(self._slots)})")  # fmt: skip
        if name not in self._provides:
            raise self._violate(f"stage {self._stage!r} wrote {name!r}, which it does not declare in provides "
                                f"(provides: {_names(self._provides)})")  # fmt: skip
        self._writes.add(name)
        setattr(ctx, name, value)

    def __delattr__(self, name: str) -> None:
        raise self._violate(f"stage {self._stage!r} deleted {name!r}: slots are written, never deleted")

    def _close(self) -> None:
        object.__setattr__(self, "_ctx", None)

    def __repr__(self) -> str:
        return f"<ContextView of stage {self._stage!r}>"


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
    reads: frozenset[str] = frozenset()  # the slots it read from earlier stages (see ContextView)
    writes: frozenset[str] = frozenset()  # the slots it wrote


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
    stage: Stage, ctx: StartupContext, tracer: Tracer, parent: Span, clock: Clock, waits_for: Sequence[str] = (),
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
        attributes={Attr.STAGE: stage.name, Attr.WAITS_FOR: list(waits_for), Attr.THREAD_NAME: thread.name,
                    Attr.THREAD_ID: thread.native_id or 0},  # fmt: skip
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
    return StageResult(name=stage.name, row=row, seconds=seconds, report=report, span_context=span.get_span_context(),
                       start_ns=t0, end_ns=t1, thread=thread.name, reads=frozenset(view._reads),
                       writes=frozenset(view._writes))  # fmt: skip


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
        results = _schedule(stages, ctx, tracer, root, clock, on_phase, concurrency)
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
    concurrency: Concurrency,
) -> list[StageResult]:
    """Start every stage whose dependencies are done; one of the ready stages runs on this thread (a sequential
    pipeline then never leaves it, and Ctrl-C lands where it always did), the others on threads of their own."""
    deps = stage_dependencies(stages, concurrency.serial)
    declared = stage_dependencies(stages)
    # The waits the few cores added (not implied by a needed slot): said on the span of the stage that waits.
    scheduling = {
        name: f"runs after {', '.join(added)}, not beside it: {concurrency.reason}"
        for name in deps
        if (added := [d for d in deps[name] if d not in declared[name]])
    }
    pending = list(stages)
    done: dict[str, StageResult] = {}
    errors: dict[str, BaseException] = {}
    finished: queue.Queue[_Outcome] = queue.Queue()
    threads: dict[str, threading.Thread] = {}

    def run(stage: Stage) -> StageResult:
        if on_phase is not None:
            on_phase(stage.name)
        return _run_one(stage, ctx, tracer, root, clock, deps[stage.name], scheduling.get(stage.name))

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
