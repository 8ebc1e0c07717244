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
from typing import Final

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

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
