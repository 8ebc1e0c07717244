"""The frames the API server and the engine core exchange, and their one codec (msgpack, through msgspec).

Two ZMQ sockets join the processes (engine/core_proc.py has the core's end, lifecycle/core_client.py the server's):
- server -> core: `ToCore` frames (AddRequest, AbortRequests, FinishSeq, Shutdown);
- core -> server: `FromCore` frames: the start-up as it happens (SpanStarted, SpanEnded, PhaseEntered, Planned),
  then Ready or Failed, and while serving one StepOutputs per step (every sequence the step advanced, batched),
  Refused for a request the core would not queue, and Notice.

Every frame is a tagged msgspec Struct, so one decoder per direction tells them apart and checks their types. A
pydantic model inside a frame (SamplingParams) travels as its fields and is validated again on arrival. Nothing here
imports torch: the API server process imports it without the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.trace import format_span_id, format_trace_id
from pydantic import BaseModel

from glowplug.profiling.phases import PhaseTable
from glowplug.profiling.tracing import span_from_record

from .outputs import SeqUpdate
from .sampling_params import SamplingParams
from .start_estimate import PhaseEstimate
from .tokenizer import TokenizerShape

# ------------------------------------------------------------------------------------------- server -> core


class AddRequest(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() on the server (one clock for both processes on Linux)


class AbortRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_ids: list[str]


class FinishSeq(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One completion ended on the server's side (a stop string in its text): free its blocks."""

    request_id: str
    index: int
    reason: str = "stop"


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Abort what is left and exit 0 (the server has drained)."""

    reason: str


ToCore = AddRequest | AbortRequests | FinishSeq | Shutdown

# ------------------------------------------------------------------------------------------- core -> server


class SpanRecord(msgspec.Struct, array_like=True, gc=False):
    """A start-up span as plain data (profiling/tracing.py span_record's fields; ids as hex: a trace id does not
    fit msgpack's 64-bit integers). `end` is None while the span runs."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    start: int
    end: int | None
    attributes: dict[str, Any]
    status: str = "UNSET"
    description: str | None = None
    events: list[tuple[str, dict[str, Any], int]] = msgspec.field(default_factory=list)
    resource: dict[str, Any] = msgspec.field(default_factory=dict)


class SpanStarted(msgspec.Struct, tag=True, array_like=True, gc=False):
    span: SpanRecord


class SpanEnded(msgspec.Struct, tag=True, array_like=True, gc=False):
    span: SpanRecord
    live: bool = True  # False: a span another rank ran, gathered at READY (the trace files keep it; no timeline)


class PhaseEntered(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The start-up moved on to a phase (the `on_phase` callback of build_engine)."""

    name: str


class Planned(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core's imports are done and the start is planned: what the ETA reads (engine/startup.py StartPlan).
    Sent again when a bundle's install changes the plan. `estimate` is the plan's PhaseEstimate as plain data
    (engine/start_estimate.py, a dataclass of numbers and strings): seconds per stage, where each comes from
    (`sources`), the pipeline's waits and contention (the critical path), so the server computes the ETA while the
    stages run as the core would. None when nothing could be predicted."""

    imports_done_ns: int  # wall clock, when the core's imports were done
    basis: str | None
    estimate: PhaseEstimate | None = None


class CoreLoad(msgspec.Struct, array_like=True, gc=False):
    """The core's queues and counters after a step: what admission and the gauges read on the server."""

    running_seqs: int
    waiting_seqs: int
    running_requests: int
    max_num_seqs: int
    prefill_backlog: int
    kv_used_blocks: int
    kv_blocks: int
    num_prompt_tokens: int
    num_generated_tokens: int
    # Per running sequence, in the same order: tokens generated so far, and its max_tokens (how long admission
    # expects the slots to stay taken).
    generated: list[int] = msgspec.field(default_factory=list)
    max_tokens: list[int] = msgspec.field(default_factory=list)
    resumed_seqs: int = 0  # preempted sequences waiting to run again (ahead of every new request)


class Ready(msgspec.Struct, tag=True, array_like=True, gc=False):
    """READY: the engine is built and its loop is about to run."""

    ready_ns: int  # wall-clock ns on the spans' time line
    vocab_size: int
    max_model_len: int
    model_dir: str
    load: CoreLoad
    phase_table: PhaseTable | None = None
    pid: int = 0
    tokenizer_shape: TokenizerShape | None = None  # the core's tokenizer's, for the server's copy


class Failed(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core cannot go on: its start failed (`stage` says where), or its loop crashed after READY."""

    reason: str
    stage: str | None = None
    after_ready: bool = False


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One step (or its first part, `partial`), batched: every sequence it advanced, the requests it scheduled for
    the first time, and the core's state after it."""

    updates: list[SeqUpdate]
    first_scheduled: list[str]
    schedule_time: float  # time.monotonic() of the step's schedule
    load: CoreLoad | None = None
    step_s: float = 0.0  # the whole step's wall time (0 for a partial)
    prefill_tokens: int = 0
    decode_rows: int = 0
    prefill_s: float = 0.0
    partial: bool = False


class Refused(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core would not queue a request (its own check failed): `status` is the HTTP status to answer."""

    request_id: str
    message: str
    status: int = 400


class Notice(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Something the server should act on: "sigterm" (the core was asked to stop: drain both)."""

    kind: str
    message: str = ""


class CoreSpec(msgspec.Struct, gc=False):
    """What the server hands a core it starts (as JSON in GLOWPLUG_CORE_SPEC, or directly to a core thread)."""

    config_json: str  # the EngineConfig
    to_core: str  # ZMQ address the core reads frames from
    from_core: str  # ZMQ address the core sends frames to
    server_pid: int
    traceparent: str | None = None  # the server's start-up span: the core's spans hang under it
    spawn_ns: int | None = None  # wall clock when the server started the process (core_process_start begins)
    origin_ns: int | None = None  # the server's process creation (the first ETA counts from it)
    pre_spans: list[SpanRecord] = msgspec.field(default_factory=list)  # the server's finished pre-main spans
    configure_logs: bool = True  # a core thread shares the server's logging set-up instead
    log_level: str = "info"
    log_json: bool | None = None
    quiet_stages: bool = False  # leave the stages' info records out (a terminal shows progress lines instead)
    tp_rundir: str | None = None  # where the tensor-parallel ranks record their stages (the server reads it)


FromCore = SpanStarted | SpanEnded | PhaseEntered | Planned | Ready | Failed | StepOutputs | Refused | Notice

# --------------------------------------------------------------------------------------------------- spans


def span_to_record(span: ReadableSpan) -> SpanRecord:
    """A span (running or finished) as plain data."""
    ctx, parent = span.context, span.parent
    return SpanRecord(
        name=span.name,
        trace_id=format_trace_id(ctx.trace_id) if ctx else "0" * 32,
        span_id=format_span_id(ctx.span_id) if ctx else "0" * 16,
        parent_id=format_span_id(parent.span_id) if parent else None,
        start=span.start_time or 0,
        end=span.end_time,
        attributes=dict(span.attributes or {}),
        status=span.status.status_code.name,
        description=span.status.description,
        events=[(e.name, dict(e.attributes or {}), e.timestamp) for e in span.events],
        resource=dict(span.resource.attributes) if span.resource is not None else {},
    )


def record_to_span(record: SpanRecord) -> ReadableSpan:
    """The span a SpanRecord describes, as this process's tools take it (the timeline, tables, trace exports)."""
    return span_from_record(
        {
            "name": record.name,
            "trace_id": int(record.trace_id, 16),
            "span_id": int(record.span_id, 16),
            "parent_id": None if record.parent_id is None else int(record.parent_id, 16),
            "start": record.start,
            "end": record.end,
            "attributes": record.attributes,
            "status": record.status,
            "description": record.description,
            "events": record.events,
            "resource": record.resource,
        }
    )


class SpanForwarder(SpanProcessor):
    """Sends every span whose name starts with `prefix` as it starts and ends (the core's start-up, to the
    server). `before_send`: a frame to send first, if it returns one (a signal the core got meanwhile)."""

    def __init__(
        self, send: Callable[[Any], None], prefix: str, *, before_send: Callable[[], Any] | None = None
    ) -> None:
        self._send = send
        self._prefix = prefix
        self._before = before_send

    def _forward(self, frame: Any) -> None:
        extra = self._before() if self._before is not None else None
        if extra is not None:
            self._send(extra)
        self._send(frame)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if span.name.startswith(self._prefix):
            self._forward(SpanStarted(span_to_record(span)))

    def on_end(self, span: ReadableSpan) -> None:
        if span.name.startswith(self._prefix):
            self._forward(SpanEnded(span_to_record(span)))

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


# --------------------------------------------------------------------------------------------------- codec


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump()
    raise NotImplementedError(f"no msgpack form for {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind.model_validate(obj)
    raise NotImplementedError(f"cannot decode {kind!r}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def encode_frame(frame: Any) -> bytes:
    """A frame (or any plain-data engine message) as msgpack bytes."""
    return _encoder.encode(frame)


def decode_frame(data: bytes | memoryview, kind: Any) -> Any:
    """The frame of type `kind` (a Struct, or a Union of tagged Structs: ToCore, FromCore) encoded in `data`."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook)
    return decoder.decode(data)
