"""Tiny in-process OTLP trace receivers for tests: OTLP/HTTP (protobuf) and OTLP/gRPC on 127.0.0.1.

Both decode real `ExportTraceServiceRequest`s with the opentelemetry-proto classes, so a test that points the
standard OTEL_EXPORTER_OTLP_* variables at one checks the whole path a collector would see.

    with OtlpHttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.traces_endpoint)
        ...  # set up tracing, make spans, shut tracing down (flushes)
        spans = rx.wait_for_spans(5)
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


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
    """OTLP/HTTP with protobuf bodies (gzip/deflate accepted). `paths` lists every POSTed path."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []
        received, paths = self.received, self.paths

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                paths.append(self.path)
                if self.path != "/v1/traces":
                    self.send_error(404, "only /v1/traces is served")
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.add(request, {k.lower(): v for k, v in self.headers.items()})
                payload = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # keep test output clean

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-http-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        """Base URL, for OTEL_EXPORTER_OTLP_ENDPOINT (the exporter appends /v1/traces)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def traces_endpoint(self) -> str:
        """Full URL, for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT."""
        return self.endpoint + "/v1/traces"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


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
