"""The server's edge against hostile or broken clients: API key, body size and read time, idle connections, and
client disconnects treated as the client's fault.

Order of the checks on a request, each before any work the next would cost:
  1. the request head must be complete within --header-read-timeout of the connection opening (or, on a kept-alive
     connection, of the head's first byte): `guarded_h11`, a uvicorn protocol that closes a connection whose head
     never completes (uvicorn has no timer before the first request, and stops its keep-alive timer at the first
     byte of the next, so a client trickling a head would hold its connection forever);
  2. the head must be at most MAX_HEAD_BYTES (431), and /v1/* needs `Authorization: Bearer <key>` when --api-key
     is set (401, compared in constant time);
  3. a Content-Length over --max-body-bytes gets 413 before one body byte is read;
  4. `read_body` reads the body against the same limit (chunked bodies have no Content-Length) and against
     --body-read-timeout for the whole body (408); a route's watch may refuse it as it arrives (a completions
     prompt already too long to fit: 400, before the rest is read);
  5. protocol.py parses it: nesting depth (400) and element count (413) before parsing, strict UTF-8, whole
     Unicode characters (400).
413 and 408 (and a 401 whose body was not read, and a watch's refusal before the body's end) close the connection:
draining a body the server refuses would cost what the limit is there to avoid. They close it lingering, as Apache
and nginx do: the response goes out with a FIN, and what the client still sends is read and dropped for up to
LINGER_S seconds before the socket closes. Closing at once, with unread bytes in the socket, would send a RST, and a
client still writing its body (most HTTP clients read the response only after sending it all) would get
"connection reset" instead of the 413.

A client that disconnects is not a server error: it is noted once on the request's access-log line (info level,
with its request id, no traceback) and counted in glowplug_client_disconnects{stage}.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ServeConfig
from .errors import ApiError
from .metrics import DisconnectStage, RejectReason, ServiceMetrics

log = structlog.get_logger("glowplug.lifecycle.transport")

# The paths an API key protects (as vLLM's --api-key does). Probes, /metrics, /startup, the page and the OpenAPI
# document stay open: orchestrators and scrapers carry no key, and none of them shows request content.
PROTECTED_PREFIX = "/v1"
# Outside /v1, the routes that take request content (tokenizing is work a stranger should not get for free).
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})
_CLOSE = {"Connection": "close"}
# State keys this module leaves in the ASGI scope for the routes.
RECEIVED_AT = "received_at"
# How long a connection closed on a refused body keeps reading (and dropping) what its client still sends.
LINGER_S = 5.0
# A body declared at least this large is read into an anonymous mapping of its own rather than the malloc heap.
MAP_BODY_BYTES = 1 << 20
# The largest request head (request line and headers): h11's own limit, which it applies only to a head still
# arriving; one that came in a single read (up to 256 KiB) would pass it.
MAX_HEAD_BYTES = 16 * 1024


# Looks at a body as it arrives (the whole of it so far, after each piece): an ApiError refuses it there, before the
# rest is read; None reads on.
BodyWatch = Callable[["BodyBuffer"], ApiError | None]


class ClientDisconnected(Exception):
    """The client went away; `stage` says when (a DisconnectStage value)."""

    def __init__(self, stage: str) -> None:
        super().__init__(f"the client disconnected during the {stage}")
        self.stage = stage


@dataclass(frozen=True)
class TransportLimits:
    """The transport settings of one server, from its ServeConfig (0 in the config = off = None here)."""

    max_body_bytes: int | None
    body_read_timeout: float | None
    max_json_depth: int
    max_json_values: int
    key_digest: bytes | None  # sha256 of the API key; the key itself is kept nowhere else

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> TransportLimits:
        key = cfg.api_key.get_secret_value() if cfg.api_key is not None else None
        return cls(
            max_body_bytes=cfg.max_body_bytes or None,
            body_read_timeout=cfg.body_read_timeout or None,
            max_json_depth=cfg.max_json_depth,
            max_json_values=cfg.max_json_values,
            key_digest=_digest(key) if key is not None else None,
        )


def _digest(value: str | bytes) -> bytes:
    # Comparing fixed-length digests keeps compare_digest's time independent of the presented key's length too.
    return hashlib.sha256(value.encode() if isinstance(value, str) else value).digest()


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


def content_length(scope: Scope) -> int | None:
    """The declared body length; None when absent (chunked) or not a number (h11 has refused those already)."""
    raw = _header(scope, b"content-length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def _has_body(scope: Scope) -> bool:
    length = content_length(scope)
    return (length is not None and length > 0) or _header(scope, b"transfer-encoding") is not None


def too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is larger than this server's limit of {limit:,} bytes (--max-body-bytes); "
        "send a smaller body",
        code="request_too_large",
        headers=_CLOSE,
    )


def note_disconnect(scope: Scope, metrics: ServiceMetrics, stage: str) -> None:
    """Record a client disconnect on the request's access-log line and in the metric (once per request)."""
    access = scope.setdefault("state", {}).setdefault("access", {})
    if "client_disconnected" in access:
        return
    access["client_disconnected"] = stage
    metrics.client_disconnects.labels(stage=stage).inc()


class BodyBuffer:
    """A request body as it arrives: in a bytearray, or, when it is large (declared >= MAP_BODY_BYTES, or chunked
    with a size limit), in an anonymous mapping reserved at its largest allowed size.

    Why a mapping: its pages are committed only as bytes arrive (a client that claims 32 MB and sends nothing
    costs nothing), nothing is copied as it grows, and `release()` hands the memory back to the OS at once. A
    large bytearray lives in the malloc heap instead: glibc raises its mmap threshold after the first large free,
    so the next large body was grown by copying and its pages stayed in the heap after the request (a 20 MB body
    grew the RSS by 40-60 MB there, and kept some)."""

    def __init__(self, capacity: int | None) -> None:
        self._map = mmap.mmap(-1, capacity) if capacity else None
        self._array = bytearray() if self._map is None else None
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, chunk: bytes) -> None:
        if self._array is not None:
            self._array += chunk
        elif self._map is not None:
            self._map[self._size : self._size + len(chunk)] = chunk
        self._size += len(chunk)

    def view(self) -> memoryview:
        """The bytes so far; release the view before `release()` (a mapping cannot close while exported)."""
        if self._array is not None:
            return memoryview(self._array)
        assert self._map is not None
        return memoryview(self._map)[: self._size]

    def release(self) -> None:
        """Give the memory back; the buffer is empty afterwards."""
        if self._map is not None:
            self._map.close()
            self._map = None
            self._array = bytearray()
        elif self._array is not None:
            self._array.clear()
        self._size = 0


def _buffer_for(scope: Scope, limit: int | None) -> BodyBuffer:
    declared = content_length(scope)
    if declared is not None:
        # Within the limit, or TransportGuard would have answered 413 already; a body longer than it declared is
        # a protocol error h11 stops at the declared length.
        return BodyBuffer(declared if declared >= MAP_BODY_BYTES else None)
    return BodyBuffer(limit)  # chunked: reserved at the limit (address space only), or a bytearray without one


async def read_body(
    scope: Scope,
    receive: Receive,
    limits: TransportLimits,
    metrics: ServiceMetrics,
    watch: BodyWatch | None = None,
) -> BodyBuffer:
    """The whole request body, read against the size limit and the read deadline; `watch`, when given, sees the
    body after each piece that arrives and may refuse it there (its ApiError is raised, with `Connection: close`
    while the client still owes body bytes: they are dropped unread, see the module doc).

    Raises ApiError 413 / 408 (counted as rejections), the watch's ApiError, or ClientDisconnected (the buffer
    released in every case)."""
    limit = limits.max_body_bytes
    started = scope.get("state", {}).get(RECEIVED_AT, time.monotonic())
    deadline = started + limits.body_read_timeout if limits.body_read_timeout is not None else None
    body = _buffer_for(scope, limit)
    try:
        await _fill(body, receive, limits, metrics, deadline, watch)
    except BaseException:
        body.release()
        raise
    return body


async def _fill(
    body: BodyBuffer,
    receive: Receive,
    limits: TransportLimits,
    metrics: ServiceMetrics,
    deadline: float | None,
    watch: BodyWatch | None,
) -> None:
    limit = limits.max_body_bytes
    while True:
        try:
            if deadline is None:
                message = await receive()
            else:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            metrics.rejected.labels(reason=RejectReason.BODY_TIMEOUT).inc()
            raise ApiError(
                408,
                f"the request body did not arrive within {limits.body_read_timeout:g} s (--body-read-timeout; "
                f"{len(body):,} bytes came)",
                code="request_timeout",
                headers=_CLOSE,
            ) from None
        if message["type"] == "http.disconnect":
            raise ClientDisconnected(DisconnectStage.BODY)
        chunk = message.get("body", b"")
        if limit is not None and len(body) + len(chunk) > limit:
            metrics.rejected.labels(reason=RejectReason.BODY_TOO_LARGE).inc()
            raise too_large(limit)
        body.append(chunk)
        more = bool(message.get("more_body", False))
        if watch is not None and chunk:
            refusal = watch(body)
            if refusal is not None:
                if more:
                    refusal.headers.update(_CLOSE)
                raise refusal
        if not more:
            return


class TransportGuard:
    """ASGI middleware: the API key, the declared body size, and client disconnects (see the module doc)."""

    def __init__(self, app: ASGIApp, *, limits: TransportLimits, metrics: ServiceMetrics) -> None:
        self.app = app
        self.limits = limits
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[RECEIVED_AT] = time.monotonic()
        refusal = self.refusal(scope)
        if refusal is not None:
            scope["state"].setdefault("access", {})["error"] = refusal.message
            await refusal.response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except ClientDisconnect:
            # Starlette's own body readers raise this (a route that reads `request.body()`); ours raise
            # ClientDisconnected and are handled where they are raised.
            note_disconnect(scope, self.metrics, DisconnectStage.BODY)

    def refusal(self, scope: Scope) -> ApiError | None:
        """The answer a request gets from its head alone (an oversized head, a missing or wrong API key, a declared
        body over the limit), counted in the rejection metric; None lets it through to the app."""
        limits = self.limits
        path = str(scope.get("path", ""))
        head_bytes = len(scope.get("raw_path", b"")) + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", []))
        if head_bytes > MAX_HEAD_BYTES:
            self.metrics.rejected.labels(reason=RejectReason.HEAD_TOO_LARGE).inc()
            headers = _CLOSE if _has_body(scope) else None
            return ApiError(
                431, f"the request head is larger than {MAX_HEAD_BYTES:,} bytes", code="head_too_large", headers=headers
            )
        if limits.key_digest is not None and (
            path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_PATHS
        ):
            problem = self._key_problem(scope)
            if problem is not None:
                self.metrics.rejected.labels(reason=RejectReason.UNAUTHORIZED).inc()
                headers = {"WWW-Authenticate": "Bearer", **(_CLOSE if _has_body(scope) else {})}
                return ApiError(401, problem, code="invalid_api_key", headers=headers)
        declared = content_length(scope)
        if limits.max_body_bytes is not None and declared is not None and declared > limits.max_body_bytes:
            self.metrics.rejected.labels(reason=RejectReason.BODY_TOO_LARGE).inc()
            return too_large(limits.max_body_bytes)
        return None

    def _key_problem(self, scope: Scope) -> str | None:
        assert self.limits.key_digest is not None
        raw = _header(scope, b"authorization")
        scheme, _, token = (raw or b"").strip().partition(b" ")
        if raw is None or scheme.lower() != b"bearer" or not token.strip():
            return (
                "missing API key: this server needs `Authorization: Bearer <key>` on /v1, /tokenize and "
                "/detokenize requests"
            )
        # Never echoed back or logged, not even in part.
        if not hmac.compare_digest(_digest(token.strip()), self.limits.key_digest):
            return "invalid API key"
        return None


class _LingeringTransport:
    """The transport as uvicorn's protocol sees it: `close()` asks the protocol first, which may linger."""

    def __init__(self, transport: asyncio.Transport, protocol: Any) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_transport()

    def is_closing(self) -> bool:
        return bool(self._protocol.lingering or self._transport.is_closing())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_h11(head_timeout: float | None, on_timeout: Callable[[], None]) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not complete `head_timeout` seconds after
    the connection opened, or after the head's first byte on a kept-alive connection (None: never; an idle
    kept-alive connection is closed by uvicorn's --timeout-keep-alive, 5 s), and closing lingering after a refused
    body (see the module doc). A request being served is never cut here; its body has --body-read-timeout."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _linger_timer: asyncio.TimerHandle | None = None
        _raw: asyncio.Transport | None = None
        lingering = False

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            if head_timeout is not None:
                self._head_timer = self.loop.call_later(head_timeout, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            serving = self.cycle is not None and not self.cycle.response_complete
            if serving or self.transport.is_closing():
                return
            on_timeout()
            # Debug only: hundreds of these are what a slow-head attack looks like; the metric counts them.
            client = f"{self.client[0]}:{self.client[1]}" if self.client else None
            log.debug("connection closed: no complete request head", client=client, timeout_s=head_timeout)
            self.transport.close()

        def close_transport(self) -> None:
            """Close now, or half-close and linger when the client still owes body bytes of a refused request."""
            raw = self._raw
            assert raw is not None
            if self.lingering or raw.is_closing():
                return
            owes_body = self.cycle is not None and self.cycle.more_body and not self.cycle.disconnected
            if not owes_body or not raw.can_write_eof():
                raw.close()
                return
            self.lingering = True
            self._disarm_head_timer()
            raw.resume_reading()  # flow control may have paused it while the body was being refused
            raw.write_eof()  # after the response bytes still buffered
            self._linger_timer = self.loop.call_later(LINGER_S, raw.close)

        def connection_made(self, transport: Any) -> None:
            self._raw = transport
            super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self.lingering:
                return  # the rest of a refused body: dropped unparsed
            # The first bytes of a next request head on a kept-alive connection: uvicorn stops its keep-alive timer
            # here and starts none for the head; this one runs until the head is complete.
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()
            super().data_received(data)

        def eof_received(self) -> None:
            if self.lingering and self._raw is not None:
                self._raw.close()  # the client has sent all it will: nothing left to linger for
                return
            super().eof_received()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request head arrived: its request is being served
                self._disarm_head_timer()

        def shutdown(self) -> None:
            if self.lingering and self._raw is not None:
                self._raw.close()  # the server is stopping: no lingering past it
                return
            super().shutdown()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol
