"""A real OTLP/HTTP trace receiver on 127.0.0.1 for the tracing-overhead benchmark.

`glowplug bench startup` compares starts exporting to a collector with starts that export nothing; the
collector side must really accept and decode the protobuf requests (an endpoint that refuses connections would
make the exporter's retries part of the measurement, and one that does not exist measures nothing). This one
decodes each `ExportTraceServiceRequest` with the opentelemetry-proto classes and counts the spans.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


class OtlpSink:
    """`with OtlpSink() as sink:` then point OTEL_EXPORTER_OTLP_ENDPOINT at `sink.endpoint`; `sink.spans` counts."""

    def __init__(self) -> None:
        self.spans = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server protocol
                from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink._lock:
                    sink.spans += count
                    sink.requests += 1
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet: a benchmark's stderr
                pass

        return Handler

    def __enter__(self) -> OtlpSink:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="glowplug-otlp-sink", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None and self._thread is not None
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
