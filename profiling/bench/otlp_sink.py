"""A real OTLP/HTTP trace receiver on 127.0.0.1: the tracing-overhead benchmark's collector, and the tests' HTTP one.

`glowplug bench startup` compares starts exporting to a collector with starts that export nothing; the
collector side must really accept and decode the protobuf requests (an endpoint that refuses connections would
make the exporter's retries part of the measurement, and one that does not exist measures nothing). This one
serves POST /v1/traces as a collector does (gzip and deflate bodies accepted, any other path 404), decodes each
`ExportTraceServiceRequest` with the opentelemetry-proto classes and counts its spans. The tests
(tests/otlp_receiver.py) keep every decoded request through `on_export` and assert on the spans in it.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

TRACES_PATH = "/v1/traces"  # what an exporter given the base endpoint appends (the OTLP/HTTP spec's default)

# Called with each decoded request and its headers (names lower-cased), on the server's thread, before the reply.
ExportHook = Callable[["ExportTraceServiceRequest", dict[str, str]], None]


class OtlpSink:
    """`with OtlpSink() as sink:` then point OTEL_EXPORTER_OTLP_ENDPOINT at `sink.endpoint` (or
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT at `sink.traces_endpoint`); `sink.spans` and `sink.requests` count what
    arrived, `sink.paths` lists every POSTed path."""

    def __init__(self, on_export: ExportHook | None = None) -> None:
        self.spans = 0
        self.requests = 0
        self.paths: list[str] = []
        self._on_export = on_export
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        """Base URL, for OTEL_EXPORTER_OTLP_ENDPOINT (the exporter appends /v1/traces)."""
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def traces_endpoint(self) -> str:
        """Full URL, for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT."""
        return self.endpoint + TRACES_PATH

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server protocol
                # Imported here: the benchmark module that starts a sink need not pay for protobuf until a request.
                from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                with sink._lock:
                    sink.paths.append(self.path)
                if self.path != TRACES_PATH:
                    self.send_error(404, f"only {TRACES_PATH} is served")
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink._lock:
                    sink.spans += count
                    sink.requests += 1
                if sink._on_export is not None:
                    # Before the reply: an exporter's flush returns only once what it sent has been taken in.
                    sink._on_export(request, {k.lower(): v for k, v in self.headers.items()})
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet: a benchmark's stderr
                pass

        return Handler

    def start(self) -> None:
        """Listen on a free port of 127.0.0.1 and serve on a daemon thread."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="glowplug-otlp-sink", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        assert self._server is not None and self._thread is not None, "not started"
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> OtlpSink:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
