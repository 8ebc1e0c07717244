"""Per-request observability: the access-log middleware (structlog, with a request id) and the request span.

The middleware is plain ASGI rather than Starlette's BaseHTTPMiddleware, which would buffer streamed responses
and hide client disconnects from the route. It logs one line when the response is complete (for a stream: when
the last chunk went out), with fields handlers add on the way through `access_fields(request)`.

Request spans (`glowplug.request`) continue an incoming W3C `traceparent`, so a client's trace shows the
server's part of each call; they are only made for generation routes, not for probes and scrapes.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, format_span_id, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glowplug.profiling.names import REQUEST_SPAN, Attr, ReqAttr

from .generation import GenerationStats

access_log = structlog.get_logger("glowplug.access")

REQUEST_ID_HEADER = "x-request-id"
# A client's id is echoed into logs and headers, so only a harmless shape is taken over.
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_PROPAGATOR = TraceContextTextMapPropagator()
# Probes and scrapes arrive every few seconds forever (and a 503 from /health/ready is routine during start-up):
# logged at debug so that the info log is about traffic.
QUIET_PATHS = frozenset({"/health/live", "/health/ready", "/metrics", "/startup"})


def request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id", ""))


def access_fields(request: Request) -> dict[str, Any]:
    """The mutable dict whose items the access-log line will carry."""
    state = request.scope.setdefault("state", {})
    fields: dict[str, Any] = state.setdefault("access", {})
    return fields


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get(REQUEST_ID_HEADER, "")
        rid = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        fields: dict[str, Any] = state.setdefault("access", {})
        status = 500
        sent = 0
        t0 = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                await self.app(scope, receive, send_wrapper)
            finally:
                client = scope.get("client")
                path = scope.get("path", "")
                level = "debug" if path in QUIET_PATHS else "warning" if status >= 500 else "info"
                getattr(access_log, level)(
                    "http request",
                    method=scope.get("method"),
                    path=path,
                    status=status,
                    duration_ms=round((time.perf_counter() - t0) * 1000, 3),
                    bytes_sent=sent,
                    client=f"{client[0]}:{client[1]}" if client else None,
                    **fields,
                )


class RequestTrace:
    """The `glowplug.request` span of one generation request; ended by `finish` or `fail`, once."""

    def __init__(
        self,
        tracer: trace.Tracer,
        headers: Mapping[str, str],
        *,
        route: str,
        request_id: str,
        access: dict[str, Any],
    ) -> None:
        parent = _PROPAGATOR.extract(carrier=dict(headers))
        self.span = tracer.start_span(
            REQUEST_SPAN,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.route": route, "http.request.method": "POST", ReqAttr.REQUEST_ID: request_id},
        )
        self._access = access
        self._ended = False
        ctx = self.span.get_span_context()
        if ctx.is_valid:
            access["trace_id"] = format_trace_id(ctx.trace_id)
            access["span_id"] = format_span_id(ctx.span_id)

    def finish(self, stats: GenerationStats, status: int = 200) -> None:
        if self._ended:
            return
        self._ended = True
        attrs: dict[str, Any] = {
            ReqAttr.PROMPT_TOKENS: stats.prompt_tokens,
            ReqAttr.COMPLETION_TOKENS: stats.completion_tokens,
            ReqAttr.FINISH_REASON: stats.finish_reason,
            "http.response.status_code": status,
        }
        if stats.ttft_s is not None:
            attrs[ReqAttr.TTFT_S] = stats.ttft_s
        if stats.queue_time_s is not None:
            attrs[ReqAttr.QUEUE_TIME_S] = stats.queue_time_s
        self.span.set_attributes(attrs)
        if stats.error is not None:
            self.span.set_status(Status(StatusCode.ERROR, stats.error))
        self._access.update(
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            finish_reason=stats.finish_reason,
            ttft_s=None if stats.ttft_s is None else round(stats.ttft_s, 6),
            queue_time_s=None if stats.queue_time_s is None else round(stats.queue_time_s, 6),
        )
        self.span.end()

    def fail(self, status: int, message: str) -> None:
        """The request was answered with an error before (or instead of) generating."""
        if self._ended:
            return
        self._ended = True
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, message))
        self.span.set_attribute(Attr.ERROR, message)
        self._access["error"] = message
        self.span.end()
