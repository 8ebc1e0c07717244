"""The engine core on its own: the start-up, then a busy loop that steps the engine and nothing else.

`glowplug serve` starts it as `python -m glowplug.engine.core_proc` (the API server's lifecycle/core_client.py
passes a `CoreSpec` in GLOWPLUG_CORE_SPEC); a server given an engine factory (tests, embedders) runs the same code
on a thread instead (`run_core(..., factory=...)`). Either way it talks to the server only through two ZMQ
sockets and the frames of engine/core_frames.py:

- the start-up: every `glowplug.startup*` span as it starts and ends (SpanStarted/SpanEnded: the server's
  timeline, page, /startup and terminal progress read them as if they were its own), each phase entered, the
  plan and ETA once the imports are done (Planned), then Ready (with the phase table) or Failed. The spans hang
  under the server's start-up span (its traceparent comes in the spec), so both processes make one trace. The
  core adds two rows of its own: `core_process_start` (the server starts it -> its first line) and `core_imports`.
- serving: each loop takes every frame waiting (adds, aborts, finished completions, shutdown), then runs one step
  and sends its outputs as one StepOutputs frame: every sequence the step advanced, with the core's state after it
  (what the server's admission decides from). A mixed step sends its prompt part first. An idle core sleeps on its
  socket and, after IDLE_TRIM_S, hands its free heap back to the OS once.

Faults: the core exits when the server is gone (it watches the server's pid), so none is left behind; a crash
sends Failed first. SIGTERM or SIGINT to the core asks the server to drain (Notice "sigterm"); the server's
Shutdown then ends it with status 0. Under tensor parallelism this process is rank 0: it starts the other ranks
(engine/distributed.py), and a rank that dies fails it.

Only the standard library is imported at module level: the `core_process_start` row ends at this module's first
line of work, and everything heavier is the `core_imports` row.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from glowplug.base.process import exit_process

from .core_channel import CoreChannel, Signals, watch_server

if TYPE_CHECKING:
    from glowplug.profiling.process import ProcessMarks

    from .core import EngineCore
    from .core_frames import CoreLoad, CoreSpec

CORE_SPEC_ENV = "GLOWPLUG_CORE_SPEC"
# After this long without a step the core counts as idle and trims the heap (malloc_trim walks every arena, so it
# waits for a lull rather than running between two closely spaced requests).
IDLE_TRIM_S = 1.0
# How long an idle core sleeps on its socket before it looks at its other duties (a rank that failed, a signal).
IDLE_POLL_MS = 100

# (config, *, on_phase=, tracing=, marks=, plan=, on_plan=, parent=) -> a StartupResult (build_engine's signature)
EngineFactory = Callable[..., Any]


def factory_kwargs(factory: EngineFactory, offered: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of `offered` keyword arguments that `factory` accepts."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    return {k: v for k, v in offered.items() if k in params}


def run_core(
    spec: CoreSpec, *, marks: ProcessMarks | None = None, factory: EngineFactory | None = None, in_thread: bool = False
) -> int:
    """Start the engine and serve until told to stop; the exit status (0: shut down, 1: it failed, and said so)."""
    from glowplug.profiling.tracing import setup_tracing

    channel = CoreChannel(spec.to_core, spec.from_core)
    signals = Signals()
    if not in_thread:
        watch_server(spec.server_pid)
        signals.install()
    tracing = setup_tracing("glowplug", in_memory=True)
    result = None
    try:
        result = _start(spec, channel, tracing, marks, factory, signals)
        if result is None:
            return 1
        return CoreLoop(result.engine.core, channel, signals, failure=_rank_failure(result)).run()
    finally:
        group = getattr(result, "parallel", None)
        if group is not None:
            group.close()  # every tensor-parallel rank stops with this one
        tracing.shutdown()  # flushes the OTLP exporter, when one is configured
        channel.close()


def _start(
    spec: CoreSpec,
    channel: CoreChannel,
    tracing: Any,
    marks: ProcessMarks | None,
    factory: EngineFactory | None,
    signals: Signals,
) -> Any:
    """The start-up, reported as it happens; the StartupResult, or None once Failed was sent."""
    from opentelemetry import context as otel_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from glowplug.profiling.logs import configure_logging
    from glowplug.profiling.names import CORE_IMPORTS, CORE_PROCESS_START, STARTUP_SPAN, Attr, stage_span_name

    from .config import EngineConfig
    from .core_frames import Failed, PhaseEntered, Planned, SpanForwarder, record_to_span

    if spec.configure_logs:
        configure_logging(level=spec.log_level, json=spec.log_json, drop=_quiet_stages if spec.quiet_stages else None)
    config = EngineConfig.model_validate_json(spec.config_json)
    tracing.provider.add_span_processor(SpanForwarder(channel.send, STARTUP_SPAN, before_send=signals.notice))
    tracer = tracing.tracer()
    parent = TraceContextTextMapPropagator().extract({"traceparent": spec.traceparent}) if spec.traceparent else None
    if marks is not None and spec.spawn_ns is not None:
        span = tracer.start_span(
            stage_span_name(CORE_PROCESS_START),
            context=parent,
            start_time=spec.spawn_ns,
            attributes={Attr.STAGE: CORE_PROCESS_START, Attr.PID: os.getpid()},
        )
        span.end(end_time=marks.main_entry_ns)
    t0 = time.perf_counter()
    import torch  # noqa: F401  (the floor's import term, as `glowplug startup` measures it)

    import_torch_s = time.perf_counter() - t0
    from . import startup
    from .host_memory import limit_native_caches

    limit_native_caches()  # a long-lived process: bound oneDNN's per-shape cache before the first GEMM
    if marks is not None:
        marks.import_torch_s = import_torch_s
        imports_done = marks.mark_imports_done()
        span = tracer.start_span(
            stage_span_name(CORE_IMPORTS),
            context=parent,
            start_time=marks.main_entry_ns,
            attributes={Attr.STAGE: CORE_IMPORTS},
        )
        span.end(end_time=imports_done)
        # The first ETA counts from the server's creation: the start the user sees began there.
        if spec.origin_ns is not None:
            marks.process_start_ns = spec.origin_ns
    tracing.add_finished([record_to_span(r) for r in spec.pre_spans])  # the server's pre-main rows, for the table
    if spec.tp_rundir is not None:
        from .tp_progress import RUNDIR_ENV

        os.environ[RUNDIR_ENV] = spec.tp_rundir

    def planned(plan: Any) -> None:
        estimate = plan.estimate
        done = marks.imports_done_ns if marks is not None and marks.imports_done_ns else time.time_ns()
        channel.send(Planned(done, plan.basis, estimate if estimate is not None and estimate.seconds else None))

    plan = None
    if config.bundle is not None:
        # The plan needs the bundle installed (its hits): build_engine makes it then and calls `planned`.
        done = marks.imports_done_ns if marks is not None and marks.imports_done_ns else time.time_ns()
        channel.send(Planned(done, "installing the bundle first; the estimate follows"))
    else:
        try:
            plan = startup.plan_start(config)
        except Exception:  # noqa: BLE001 - the ETA must never stop a start; the start says what is wrong
            pass
    if plan is not None:
        planned(plan)
    offered: dict[str, Any] = {
        "on_phase": lambda name: channel.send(PhaseEntered(name)),
        "tracing": tracing,
        "marks": marks,
        "on_plan": planned,
    }
    if plan is not None:
        offered["plan"] = plan
    build = factory or startup.build_engine
    if factory is None:
        offered["parent"] = parent
    # An injected factory that does not take `parent` still hangs its root span under the server's: the current
    # context is the parent of a span started without an explicit one.
    token = otel_context.attach(parent) if parent is not None else None
    try:
        result = build(config, **factory_kwargs(build, offered))
    except BaseException as exc:  # noqa: BLE001 - told to the server, which shows it and the failed stage
        reason = str(getattr(exc, "reason", "") or "") or f"{type(exc).__name__}: {exc}"
        stage = getattr(exc, "stage", None)
        if stage:
            reason = f"{stage}: {reason}"
        import structlog

        structlog.get_logger("glowplug.core").error("start-up failed", reason=reason, exc_info=exc)
        channel.send(Failed(reason, stage))
        return None
    finally:
        if token is not None:
            otel_context.detach(token)
    _ready(result, channel, tracing)
    return result


def _quiet_stages(event: Mapping[str, Any]) -> bool:
    """A stage's info record (key=value, hundreds of characters): the server's progress lines say it instead."""
    from glowplug.profiling.names import STARTUP_SPAN

    return event.get("level") == "info" and str(event.get("event", "")).startswith(STARTUP_SPAN)


def _no_failure() -> str | None:
    return None


def _rank_failure(result: Any) -> Callable[[], str | None]:
    group = getattr(result, "parallel", None)
    return _no_failure if group is None else group.failure


def _ready(result: Any, channel: CoreChannel, tracing: Any) -> None:
    """Tell the server READY (the table, the facts it serves with), and commit the KV pool."""
    import structlog

    from glowplug.profiling.names import STARTUP_SPAN

    from .core_frames import Ready, SpanEnded, span_to_record
    from .tokenizer import tokenizer_shape

    engine = result.engine
    core = engine.core
    table = getattr(result, "phase_table", None)
    # Spans other ranks ran (gathered at READY): for the server's trace downloads, not its live timeline.
    others = [s for s in tracing.finished_spans() if (s.attributes or {}).get("rank", 0) not in (0, None)]
    for span in others:
        channel.send(SpanEnded(span_to_record(span), live=False))
    # READY is where this start's root span ended (build_engine ends it there, before the table and the floor).
    trace_id = int(table.trace_id, 16) if table is not None and table.trace_id else None
    roots = [
        s.end_time
        for s in tracing.finished_spans()
        if s.name == STARTUP_SPAN
        and s.end_time
        and (trace_id is None or (s.context is not None and s.context.trace_id == trace_id))
    ]
    ready_ns = max(roots) if roots else time.time_ns()
    channel.send(
        Ready(
            ready_ns,
            core.vocab_size,
            core.max_model_len,
            str(getattr(result, "model_dir", "")),
            load_of(core),
            table,
            os.getpid(),
            tokenizer_shape(engine.tokenizer),
        )
    )
    log = structlog.get_logger("glowplug.core")

    def commit() -> None:
        # After READY, not in the start-up: the kernel call releases the GIL, so the footprint stops growing within
        # seconds of READY instead of creeping up as the block manager first walks the pool.
        t0 = time.perf_counter()
        committed = core.commit_kv_cache()
        log.info(
            "kv cache committed" if committed else "kv cache commits on first use (the host cannot prefault)",
            seconds=round(time.perf_counter() - t0, 3),
        )

    threading.Thread(target=commit, name="kv-commit", daemon=True).start()


def load_of(core: EngineCore) -> CoreLoad:
    """The core's queues and counters now (a few list walks: once per step)."""
    from .core_frames import CoreLoad

    sched = core.scheduler
    running = sched.running
    stats = sched.stats()
    return CoreLoad(
        len(running),
        len(sched.waiting),
        len({s.request_id for s in running}),
        stats.max_num_seqs,
        stats.prefill_backlog,
        stats.kv_blocks - stats.kv_free_blocks,
        stats.kv_blocks,
        core.num_prompt_tokens,
        core.num_generated_tokens,
        [len(s.output_token_ids) for s in running],
        [s.params.max_tokens for s in running],
        sum(1 for s in sched.waiting if s.first_scheduled_time is not None),
    )


class CoreLoop:
    """The busy loop: frames in, one step, its outputs out; until Shutdown (0) or a crash (Failed, then 1)."""

    def __init__(
        self,
        core: EngineCore,
        channel: CoreChannel,
        signals: Signals,
        *,
        failure: Callable[[], str | None] = _no_failure,
    ) -> None:
        self.core = core
        self.channel = channel
        self.signals = signals
        self.failure = failure
        self._last_step = 0.0
        self._trim_pending = False
        self._first_sent: list[str] = []

    def run(self) -> int:
        import structlog

        from .core_frames import Failed

        try:
            return self._serve()
        except BaseException as exc:  # noqa: BLE001 - the server ends every request with this reason
            structlog.get_logger("glowplug.core").error(
                "engine core crashed", error=f"{type(exc).__name__}: {exc}", exc_info=exc
            )
            # A collective fails first when a tensor-parallel rank dies: give the group's watch a moment to name it.
            deadline = time.monotonic() + 1.0
            named = self.failure()
            while named is None and self.failure is not _no_failure and time.monotonic() < deadline:
                time.sleep(0.05)
                named = self.failure()
            reason = f"DistributedError: {named}" if named is not None else f"{type(exc).__name__}: {exc}"
            try:
                self.channel.send(Failed(f"engine loop: {reason}", after_ready=True))
            except Exception:  # noqa: BLE001 - the server is gone too: nobody is left to tell
                pass
            return 1

    def _serve(self) -> int:
        from .core_frames import AbortRequests, AddRequest, FinishSeq, Refused, Shutdown, StepOutputs

        core, channel = self.core, self.channel
        while True:
            busy = core.has_unfinished()
            frames = channel.receive(0 if busy else self._idle_wait())
            for frame in frames:
                if isinstance(frame, AddRequest):
                    try:
                        core.add(frame.request_id, frame.prompt_token_ids, frame.params, frame.arrival_time)
                    except ValueError as exc:
                        channel.send(Refused(frame.request_id, str(exc), 400))
                elif isinstance(frame, AbortRequests):
                    for rid in frame.request_ids:
                        core.abort(rid)
                elif isinstance(frame, FinishSeq):
                    core.finish(frame.request_id, frame.index, frame.reason)
                elif isinstance(frame, Shutdown):
                    for rid in core.request_ids():
                        core.abort(rid)
                    return 0
            notice = self.signals.notice()
            if notice is not None:
                channel.send(notice)
            failed = self.failure()
            if failed is not None:
                from .distributed import DistributedError

                raise DistributedError(failed)
            if core.has_unfinished():
                self._step()
            elif frames:
                # Nothing left to step (the last requests were aborted): the server still hears the freed blocks.
                channel.send(StepOutputs([], [], time.monotonic(), load_of(core), partial=True))

    def _idle_wait(self) -> int:
        """How long to sleep on the socket: until the heap trim is due, else one poll period. Trims once per lull."""
        if self._trim_pending:
            left = IDLE_TRIM_S - (time.monotonic() - self._last_step)
            if left <= 0:
                from .host_memory import release_free_heap

                self._trim_pending = False
                release_free_heap()
            else:
                return max(1, min(IDLE_POLL_MS, int(left * 1000) + 1))
        return IDLE_POLL_MS

    def _partial(self, updates: list[Any]) -> None:
        from .core_frames import StepOutputs

        core = self.core
        self._first_sent = core.last_first_scheduled
        # With the state after the schedule: the server gives back the admission slots of the requests scheduled
        # here now, and must count them as running from then on, not a step later.
        self.channel.send(
            StepOutputs(updates, core.last_first_scheduled, core.last_schedule_time, load_of(core), partial=True)
        )

    def _step(self) -> None:
        from .core_frames import StepOutputs

        core = self.core
        self._first_sent = []
        t0 = time.perf_counter()
        updates = core.step(on_partial=self._partial)
        step_s = time.perf_counter() - t0
        first = [] if self._first_sent else core.last_first_scheduled
        shape = core.last_step
        self.channel.send(
            StepOutputs(
                updates,
                first,
                core.last_schedule_time,
                load_of(core),
                step_s,
                shape.prefill_tokens,
                shape.decode_rows,
                shape.prefill_s,
            )
        )
        self._last_step = time.monotonic()
        self._trim_pending = True


def main() -> None:
    from glowplug.profiling.process import mark_main_entry

    marks = mark_main_entry()  # first: the core_process_start row ends here
    marks.defer_full_gc()  # this process builds one engine: see FullGcDeferral
    import msgspec

    from .core_frames import CoreSpec

    spec = msgspec.json.decode(os.environ[CORE_SPEC_ENV], type=CoreSpec)
    exit_process(run_core(spec, marks=marks))


if __name__ == "__main__":
    main()
