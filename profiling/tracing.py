"""Tracer set-up: an explicit TracerProvider, an in-memory copy of every span, OTLP export when configured.

The provider is passed around explicitly rather than read from the process-global one, so tests, benchmarks and a
library user embedding the engine each get their own spans; `Tracing.install_global()` opts into the global
provider for third-party instrumentation.

OTLP export follows the standard environment variables (the exporters read the endpoint, headers, timeout and
compression themselves, so every documented variable keeps working):
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT   turn export on
  OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL   http/protobuf (default) or grpc
  OTEL_SDK_DISABLED=true, or OTEL_TRACES_EXPORTER=none                turn export off again
With neither endpoint set no exporter, thread or connection is created.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Final

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from .names import Attr

INSTRUMENTATION_NAME: Final = "glowplug"
PROTOCOLS: Final = ("http/protobuf", "grpc")
DEFAULT_PROTOCOL: Final = "http/protobuf"


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class OtlpTarget:
    protocol: str
    endpoint: str


def otlp_target_from_env(environ: Mapping[str, str] | None = None) -> OtlpTarget | None:
    """The OTLP destination the standard variables ask for, or None when export is off.

    Raises ValueError for a protocol the Python exporters cannot speak (e.g. http/json), because silently dropping
    traces someone configured is worse than a start-up error that names the variable.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if "none" in {p.strip().lower() for p in env.get("OTEL_TRACES_EXPORTER", "").split(",")}:
        return None
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        if env.get(var):
            protocol = env[var].strip().lower()
            if protocol not in PROTOCOLS:
                raise ValueError(f"{var}={env[var]!r} is not supported; use one of {', '.join(PROTOCOLS)}")
            break
    else:
        protocol = DEFAULT_PROTOCOL
    return OtlpTarget(protocol=protocol, endpoint=endpoint)


def _otlp_exporter(target: OtlpTarget) -> SpanExporter:
    # Imported here: each exporter pulls in requests or grpc, which a run without export should not pay for.
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


class DeferredOtlpExporter(SpanExporter):
    """The OTLP exporter, built on its first export rather than at set-up. Importing an exporter (protobuf, plus
    requests or grpc) is a visible share of a warm start (the tracing-overhead section of reports/startup/), and the
    batch processor's first export comes from its own thread after the spans are queued, at the latest when the
    provider shuts down: so the import leaves the path to READY and no span is lost."""

    def __init__(self, target: OtlpTarget) -> None:
        self._target = target
        self._real: SpanExporter | None = None
        self._lock = threading.Lock()

    def _exporter(self) -> SpanExporter:
        with self._lock:
            if self._real is None:
                self._real = _otlp_exporter(self._target)
            return self._real

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self._exporter().export(spans)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._real.force_flush(timeout_millis) if self._real is not None else True

    def shutdown(self) -> None:
        if self._real is not None:
            self._real.shutdown()


@dataclass
class Tracing:
    """A TracerProvider plus the exporters attached to it."""

    provider: TracerProvider
    memory: InMemorySpanExporter | None
    otlp: OtlpTarget | None
    _shut_down: bool = field(default=False, repr=False)

    def tracer(self, name: str = INSTRUMENTATION_NAME) -> trace.Tracer:
        return self.provider.get_tracer(name, _package_version("glowplug"))

    def finished_spans(self) -> tuple[ReadableSpan, ...]:
        """Every span ended so far (empty without the in-memory exporter)."""
        return self.memory.get_finished_spans() if self.memory is not None else ()

    def clear(self) -> None:
        if self.memory is not None:
            self.memory.clear()

    def add_finished(self, spans: Sequence[ReadableSpan]) -> None:
        """Keep spans another process finished (a tensor-parallel worker's start-up) with this one's."""
        if self.memory is not None and spans:
            self.memory.export(list(spans))

    def install_global(self) -> None:
        """Make this the process-global provider (OTel allows that once per process)."""
        trace.set_tracer_provider(self.provider)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Flush queued spans to every exporter and stop their threads; safe to call twice."""
        if not self._shut_down:
            self._shut_down = True
            self.provider.shutdown()


def setup_tracing(service_name: str = "glowplug", *, in_memory: bool = True) -> Tracing:
    """Build a TracerProvider; see the module docstring for what gets attached when."""
    resource = Resource.create({"service.name": service_name, "service.version": _package_version("glowplug")})
    provider = TracerProvider(resource=resource)
    memory: InMemorySpanExporter | None = None
    if in_memory:
        memory = InMemorySpanExporter()
        # Synchronous on purpose: the phase table is read right after the last stage ends and must see it.
        provider.add_span_processor(SimpleSpanProcessor(memory))
    target = otlp_target_from_env()
    if target is not None:
        # Batched: a slow or absent collector must never stall a stage or a request.
        provider.add_span_processor(BatchSpanProcessor(DeferredOtlpExporter(target)))
    return Tracing(provider=provider, memory=memory, otlp=target)


class RankAttributes(SpanProcessor):
    """Stamps `rank` and `world_size` on every span a tensor-parallel rank starts, so that every rank's spans can
    share one trace and still be told apart (the phase table's per-rank rows, one Perfetto lane per rank)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.attributes = {Attr.RANK: rank, Attr.WORLD_SIZE: world_size}

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        span.set_attributes(self.attributes)

    def on_end(self, span: ReadableSpan) -> None:
        pass


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as plain data (spans hold locks and cannot be pickled): what a worker hands rank 0."""
    ctx, parent = span.context, span.parent
    return {
        "name": span.name,
        "trace_id": ctx.trace_id if ctx else 0,
        "span_id": ctx.span_id if ctx else 0,
        "parent_id": parent.span_id if parent else None,
        "start": span.start_time,
        "end": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "description": span.status.description,
        "events": [(e.name, dict(e.attributes or {}), e.timestamp) for e in span.events],
        "resource": dict(span.resource.attributes) if span.resource is not None else {},
    }


def span_from_record(record: Mapping[str, Any]) -> ReadableSpan:
    """The span `span_record` described, as a finished span of this process's tools (tables, exports)."""
    from opentelemetry.sdk.trace import Event
    from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

    ctx = SpanContext(record["trace_id"], record["span_id"], False, TraceFlags(TraceFlags.SAMPLED))
    parent = (
        SpanContext(record["trace_id"], record["parent_id"], False, TraceFlags(TraceFlags.SAMPLED))
        if record["parent_id"] is not None
        else None
    )
    return ReadableSpan(
        name=record["name"],
        context=ctx,
        parent=parent,
        resource=Resource.create(record["resource"]),
        attributes=record["attributes"],
        events=[Event(n, a, t) for n, a, t in record["events"]],
        status=Status(StatusCode[record["status"]], record["description"]),
        start_time=record["start"],
        end_time=record["end"],
    )
