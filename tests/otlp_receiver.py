"""Tiny in-process OTLP trace receivers for tests: OTLP/HTTP (protobuf) and OTLP/gRPC on 127.0.0.1.

Both decode real `ExportTraceServiceRequest`s with the opentelemetry-proto classes, so a test that points the
standard OTEL_EXPORTER_OTLP_* variables at one checks the whole path a collector would see. The HTTP one is the
package's own receiver (glowplug.profiling.bench.otlp_sink, the tracing benchmark's collector), keeping every
request it decodes.

    with OtlpHttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.traces_endpoint)
        ...  # set up tracing, make spans, shut tracing down (flushes)
        spans = rx.wait_for_spans(5)
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from glowplug.profiling.bench.otlp_sink import OtlpSink


def decode_any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [decode_any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: decode_any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex, as in trace UIs and OTLP/JSON
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    event_names: tuple[str, ...]
    resource: dict[str, Any] = field(default_factory=dict)


def flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    out: list[ReceivedSpan] = []
    for rs in request.resource_spans:
        resource = {kv.key: decode_any_value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={kv.key: decode_any_value(kv.value) for kv in s.attributes},
                        status_code=s.status.code,
                        status_message=s.status.message,
                        event_names=tuple(e.name for e in s.events),
                        resource=resource,
                    )
                )
    return out


class _Received:
    """Thread-safe store of decoded requests with a wait."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metadata: list[dict[str, str]] = []

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest, metadata: dict[str, str]) -> None:
        with self._cond:
            self.requests.append(request)
            self.metadata.append(metadata)
            self._cond.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return [span for request in self.requests for span in flatten(request)]

    def wait_for_spans(self, count: int, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """At least `count` spans, or AssertionError after `timeout_s` naming what did arrive."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                spans = [span for request in self.requests for span in flatten(request)]
                remaining = deadline - time.monotonic()
                if len(spans) >= count or remaining <= 0:
                    break
                self._cond.wait(remaining)
        if len(spans) < count:
            raise AssertionError(f"received {len(spans)} spans, wanted {count}: {[s.name for s in spans]}")
        return spans


class _ReceiverBase:
    def __init__(self) -> None:
        self.received = _Received()

    def spans(self) -> list[ReceivedSpan]:
        return self.received.spans()

    def wait_for_spans(self, count: int, timeout_s: float = 10.0) -> list[ReceivedSpan]:
        return self.received.wait_for_spans(count, timeout_s)

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class OtlpHttpReceiver(_ReceiverBase):
    """OTLP/HTTP with protobuf bodies (gzip/deflate accepted): the package's OtlpSink, keeping every request it
    decodes. `paths` lists every POSTed path."""

    def __init__(self) -> None:
        super().__init__()
        self._sink = OtlpSink(on_export=self.received.add)

    @property
    def paths(self) -> list[str]:
        return self._sink.paths

    @property
    def endpoint(self) -> str:
        """Base URL, for OTEL_EXPORTER_OTLP_ENDPOINT (the exporter appends /v1/traces)."""
        return self._sink.endpoint

    @property
    def traces_endpoint(self) -> str:
        """Full URL, for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT."""
        return self._sink.traces_endpoint

    def start(self) -> None:
        self._sink.start()

    def stop(self) -> None:
        self._sink.stop()


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: _Received) -> None:
        self._received = received

    def Export(  # noqa: N802 (generated gRPC naming)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._received.add(request, {k: v for k, v in context.invocation_metadata()})  # type: ignore[misc]
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpGrpcReceiver(_ReceiverBase):
    """OTLP/gRPC (insecure) implementing opentelemetry-proto's TraceService."""

    def __init__(self) -> None:
        super().__init__()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self.received), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        """For OTEL_EXPORTER_OTLP_ENDPOINT / _TRACES_ENDPOINT; the http scheme makes the exporter use plaintext."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=None).wait(5)
