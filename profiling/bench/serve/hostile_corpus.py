"""A corpus of hostile and broken requests, sent over real sockets to one running server (127.0.0.1 only).

Groups: sizes (bodies over the limit, declared and chunked; a prompt that cannot fit; oversized headers), depths
(nesting past the limit, in unknown fields and in the prompt; at the limit; brackets inside strings), encodings
(lone surrogates in each kind of field, invalid UTF-8, UTF-16, truncated JSON), slow and truncated bodies and
heads (raw sockets: half a body then silence, a trickled body, a trickled head, a client that hangs up during its
body, during generation or mid-stream), idle connections (hundreds at once) and the API key.

Each case says what a correct server answers: a 4xx (with the code where the server has one), a clean close
(FIN, never a reset), or, for the boundary cases that are valid requests, 200. After every case the runner checks
that the server is READY and that a normal request succeeds. Every socket has a timeout and every case a bounded
number of sends, so the corpus ends in bounded time whatever the server does.

Used by tests/lifecycle/test_hostile.py (a tiny model, small limits) and `glowplug bench serve --hostile`.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

# A request head longer than h11's limit (16 KiB): uvicorn answers 400 and closes.
_HUGE_HEADER = 64 * 1024
_CHUNK = 64 * 1024
CLOSED = "closed"  # the outcome of a case whose correct end is a clean close, not a response


@dataclass(frozen=True)
class Target:
    """The server under test and the limits it was started with (the cases are sized from them)."""

    host: str
    port: int
    model: str
    api_key: str | None
    max_body_bytes: int
    max_json_depth: int
    max_json_values: int
    body_read_timeout: float
    header_read_timeout: float
    max_model_len: int
    idle_connections: int = 300

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class Outcome:
    """What the server did: `status` of its response (None: no response), `closed` cleanly (FIN) or `reset`."""

    status: int | None = None
    code: str | None = None  # the OpenAI error code of a JSON error body
    closed: bool = False
    reset: bool = False
    seconds: float = 0.0
    note: str = ""


@dataclass
class CaseResult:
    name: str
    group: str
    expected: str
    outcome: Outcome
    ok: bool
    ready_after: bool
    normal_after: bool

    @property
    def passed(self) -> bool:
        return self.ok and self.ready_after and self.normal_after


@dataclass(frozen=True)
class Case:
    name: str
    group: str
    run: Callable[[Target], Outcome]
    # 200, a 4xx status, "4xx", CLOSED, or "4xx|closed"; `code`, when set, must be the error body's code.
    expect: int | str
    code: str | None = None

    def judge(self, out: Outcome) -> bool:
        if out.status is not None and out.status >= 500:
            return False
        if out.reset:
            return False
        if self.code is not None and out.code != self.code:
            return False
        if isinstance(self.expect, int):
            return out.status == self.expect
        if self.expect == "4xx":
            return out.status is not None and 400 <= out.status < 500
        if self.expect == CLOSED:
            return out.status is None and out.closed
        return (out.status is not None and 400 <= out.status < 500) or (out.status is None and out.closed)


# ---------------------------------------------------------------- raw HTTP over a socket


class Raw:
    """One client connection: send bytes, read one response (or notice a close), every step with a deadline."""

    def __init__(self, t: Target, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection((t.host, t.port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.timeout = timeout

    def send(self, data: bytes) -> bool:
        """False when the server has closed or reset (the caller then reads what it answered)."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def readable(self) -> bool:
        return bool(select.select([self.sock], [], [], 0)[0])

    def send_body(self, head: bytes, body_len: int, fill: bytes = b"a", prefix: bytes = b"") -> bool:
        """Send `head`, then `prefix` and fill bytes up to `body_len`, stopping early when the server answers."""
        if not self.send(head + prefix):
            return False
        left = body_len - len(prefix)
        chunk = fill * (_CHUNK // len(fill))
        while left > 0:
            if self.readable():
                return False
            piece = chunk[: min(left, len(chunk))]
            if not self.send(piece):
                return False
            left -= len(piece)
        return True

    def response(self, timeout: float | None = None) -> Outcome:
        """Read one response; a close before any byte is `closed` (FIN) or `reset`."""
        t0 = time.monotonic()
        deadline = t0 + (timeout if timeout is not None else self.timeout)
        out = Outcome()
        try:
            while b"\r\n\r\n" not in self.buf:
                data = self.recv(deadline)
                if not data:
                    out.closed = True
                    out.seconds = time.monotonic() - t0
                    return out
                self.buf += data
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            out.status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            length = int(headers.get("content-length", "0"))
            while len(rest) < length:
                data = self.recv(deadline)
                if not data:
                    break
                rest += data
            self.buf = rest[length:]
            body = rest[:length]
            if headers.get("content-type", "").startswith("application/json") and body:
                err = json.loads(body).get("error")
                out.code = err.get("code") if isinstance(err, dict) else None
            out.note = body[:160].decode("utf-8", "replace")
        except ConnectionResetError:
            out.reset = True
        except TimeoutError:
            out.note = "no response before the deadline"
        out.seconds = time.monotonic() - t0
        return out

    def wait_closed(self, timeout: float) -> Outcome:
        """Read until the server closes (FIN: closed; RST: reset; nothing by `timeout`: neither)."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        out = Outcome()
        try:
            while True:
                data = self.recv(deadline)
                if not data:
                    out.closed = True
                    break
        except ConnectionResetError:
            out.reset = True
        except TimeoutError:
            out.note = f"still open after {timeout:g} s"
        out.seconds = time.monotonic() - t0
        return out

    def recv(self, deadline: float) -> bytes:
        """The next bytes the server sent (b"" once it closed); TimeoutError when none came by `deadline`."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        try:
            return self.sock.recv(_CHUNK)
        except TimeoutError:
            raise TimeoutError from None

    def close(self) -> None:
        self.sock.close()


def head(
    t: Target, path: str, length: int | None, *, chunked: bool = False, auth: bool = True, extra: str = ""
) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {t.host}:{t.port}", "Content-Type: application/json"]
    if auth:
        lines += [f"{k}: {v}" for k, v in t.auth().items()]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    if extra:
        lines.append(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def post(t: Target, path: str, body: bytes, *, auth: bool = True, timeout: float = 60.0, extra: str = "") -> Outcome:
    conn = Raw(t, timeout)
    try:
        conn.send(head(t, path, len(body), auth=auth, extra=extra) + body)
        return conn.response()
    finally:
        conn.close()


def get(t: Target, path: str, *, auth: bool = True, timeout: float = 30.0, extra: str = "") -> Outcome:
    conn = Raw(t, timeout)
    try:
        lines = [f"GET {path} HTTP/1.1", f"Host: {t.host}:{t.port}"]
        lines += [f"{k}: {v}" for k, v in t.auth().items()] if auth else []
        lines += [extra] if extra else []
        conn.send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        return conn.response()
    finally:
        conn.close()


def completion(t: Target, **fields: Any) -> bytes:
    return json.dumps({"model": t.model, "max_tokens": 2, "temperature": 0.0, **fields}).encode()


def chat(t: Target, content: str, **fields: Any) -> bytes:
    body = {"model": t.model, "max_tokens": 2, "messages": [{"role": "user", "content": content}], **fields}
    return json.dumps(body).encode()


# ---------------------------------------------------------------- the cases


def _declared(t: Target, n: int) -> Outcome:
    """A body of `n` bytes, declared by Content-Length and sent until the server answers."""
    conn = Raw(t)
    try:
        conn.send_body(head(t, "/v1/completions", n), n, prefix=b'{"prompt": "hi", "pad": "')
        return conn.response()
    finally:
        conn.close()


def _over_limit_declared(t: Target) -> Outcome:
    return _declared(t, t.max_body_bytes + 1)


def _huge_declared(t: Target) -> Outcome:
    # 100 MB declared; the server must answer without reading it (the client stops when the answer comes).
    return _declared(t, 100_000_000)


def _over_limit_chunked(t: Target) -> Outcome:
    conn = Raw(t)
    try:
        if not conn.send(head(t, "/v1/completions", None, chunked=True)):
            return conn.response()
        sent = 0
        piece = b"a" * _CHUNK
        frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        conn.send(b'10\r\n{"prompt": "hi",\r\n')
        while sent <= t.max_body_bytes + _CHUNK and not conn.readable():
            if not conn.send(frame):
                break
            sent += len(piece)
        return conn.response()
    finally:
        conn.close()


def _prompt_cannot_fit(t: Target) -> Outcome:
    # The largest prompt the body limit lets through ("hello world " repeated), far over any context: refused by
    # its length in characters before it is tokenized.
    reps = max(1, (t.max_body_bytes - 256) // 12)
    return post(t, "/v1/completions", completion(t, prompt="hello world " * reps))


def _prompt_of(text: str, chars: Callable[[Target], int]) -> Callable[[Target], Outcome]:
    def run(t: Target) -> Outcome:
        n = chars(t)
        return post(t, "/v1/completions", completion(t, prompt=(text * (n // len(text) + 1))[:n]))

    return run


def _huge_header(t: Target) -> Outcome:
    return get(t, "/v1/models", extra="X-Pad: " + "a" * _HUGE_HEADER)


def _deep(where: str, levels: int) -> Callable[[Target], Outcome]:
    def run(t: Target) -> Outcome:
        nest = b"[" * levels + b"]" * levels
        if where == "unknown":
            body = b'{"model": "' + t.model.encode() + b'", "prompt": "hi", "max_tokens": 2, "x": ' + nest + b"}"
        elif where == "prompt":
            body = b'{"prompt": ' + nest + b"}"
        else:
            body = b'{"messages": [{"role": "user", "content": ' + nest + b"}]}"
        return post(t, "/v1/chat/completions" if where == "content" else "/v1/completions", body)

    return run


def _at_depth_limit(t: Target) -> Outcome:
    # The body object is one level; the unknown field adds the rest: exactly the limit, which must pass.
    levels = t.max_json_depth - 1
    nest = b"[" * levels + b"]" * levels
    body = b'{"model": "' + t.model.encode() + b'", "prompt": "hi", "max_tokens": 2, "x": ' + nest + b"}"
    return post(t, "/v1/completions", body)


def _many_values(t: Target) -> Outcome:
    # Token ids, one more than the limit allows: refused from the commas, before json.loads builds the list.
    n = t.max_json_values + 1
    return post(t, "/v1/completions", b'{"prompt": [' + b"1," * (n - 1) + b"1]}")


def _commas_in_strings(t: Target) -> Outcome:
    # As many commas as the limit, all inside a string: not values; the request is served.
    return post(t, "/v1/completions", completion(t, prompt="hi", user="," * t.max_json_values))


def _brackets_in_strings(t: Target) -> Outcome:
    return post(t, "/v1/completions", completion(t, prompt="hi", user="[{" * 5000))


def _raw_body(path: str, body: bytes) -> Callable[[Target], Outcome]:
    return lambda t: post(t, path, body)


def malformed_body_cases() -> list[Case]:
    """The encodings group's fixed malformed bodies (package data: data/hostile_bodies.json), in file order."""
    data = resources.files(__name__.rpartition(".")[0]).joinpath("data", "hostile_bodies.json")
    bodies = json.loads(data.read_text(encoding="utf-8"))["bodies"]
    return [
        Case(b["name"], "encodings", _raw_body(b["path"], b["text"].encode(b["encoding"])), b["expect"], b.get("code"))
        for b in bodies
    ]


def _surrogate_in(field_name: str) -> Callable[[Target], Outcome]:
    """A body with an escaped lone surrogate in `field_name` (valid JSON, not valid Unicode)."""

    def run(t: Target) -> Outcome:
        model = t.model.encode()
        if field_name == "content":
            body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}' % model
            return post(t, "/v1/chat/completions", body)
        if field_name == "prompt":
            return post(t, "/v1/completions", b'{"model": "%s", "prompt": "hi \\udfff"}' % model)
        value = b'["ok", "\\udbff"]' if field_name == "stop" else b'"\\udc00"'
        body = b'{"model": "%s", "prompt": "hi", "%s": %s}' % (model, field_name.encode(), value)
        return post(t, "/v1/completions", body)

    return run


def _valid_pair(t: Target) -> Outcome:
    body = b'{"model": "%s", "prompt": "rocket \\ud83d\\ude80", "max_tokens": 2}' % t.model.encode()
    return post(t, "/v1/completions", body)


def _half_body(t: Target) -> Outcome:
    conn = Raw(t, timeout=t.body_read_timeout + 10)
    try:
        conn.send(head(t, "/v1/completions", 100) + b'{"prompt": "hi"')
        out = conn.response()
        if out.status is not None:
            after = conn.wait_closed(5.0)
            out.closed, out.reset = after.closed, after.reset
        return out
    finally:
        conn.close()


# A trickling client's pace: one byte per this many seconds.
_TRICKLE_INTERVAL_S = 0.05


def _trickle(conn: Raw, data: bytes, seconds: float) -> None:
    """Send `data` one byte per _TRICKLE_INTERVAL_S for at most `seconds`, stopping once the server has answered
    (or closed) or a send fails."""
    deadline = time.monotonic() + seconds
    for i in range(len(data)):
        if conn.readable() or time.monotonic() > deadline or not conn.send(data[i : i + 1]):
            break
        time.sleep(_TRICKLE_INTERVAL_S)


def _trickled_body(t: Target) -> Outcome:
    conn = Raw(t, timeout=t.body_read_timeout + 10)
    try:
        # More bytes than the timeout lets through at this pace: the body cannot be complete in time.
        body = completion(t, prompt="hi " * int((t.body_read_timeout + 5) / _TRICKLE_INTERVAL_S / 3 + 100))
        conn.send(head(t, "/v1/completions", len(body)))
        _trickle(conn, body, t.body_read_timeout + 5)
        return conn.response()
    finally:
        conn.close()


def _hangup_during_body(t: Target) -> Outcome:
    conn = Raw(t)
    conn.send(head(t, "/v1/completions", 1000) + b'{"prompt": "hi')
    time.sleep(0.2)
    conn.close()
    return Outcome(closed=True, note="the client hung up; the server must count it, not log a 500")


def _eof_during_body(t: Target) -> Outcome:
    conn = Raw(t)
    try:
        conn.send(head(t, "/v1/completions", 1000) + b'{"prompt": "hi')
        conn.sock.shutdown(socket.SHUT_WR)  # FIN with the body incomplete
        return conn.response(timeout=10.0)
    finally:
        conn.close()


def _hangup_during(stream: bool) -> Callable[[Target], Outcome]:
    def run(t: Target) -> Outcome:
        conn = Raw(t)
        # Long enough that the answer cannot be complete before the hang-up, however fast the model is.
        body = completion(t, prompt="hello there", max_tokens=t.max_model_len // 2, ignore_eos=True, stream=stream)
        conn.send(head(t, "/v1/completions", len(body)) + body)
        if stream:
            deadline = time.monotonic() + 30
            while b"data:" not in conn.buf and time.monotonic() < deadline:
                conn.buf += conn.recv(deadline) or b""
        else:
            time.sleep(0.3)
        conn.close()
        return Outcome(closed=True, note="the client hung up; the server must abort and count it")

    return run


def _partial_head(t: Target) -> Outcome:
    conn = Raw(t, timeout=t.header_read_timeout + 10)
    try:
        conn.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        return conn.wait_closed(t.header_read_timeout + 5)
    finally:
        conn.close()


def _trickled_head(t: Target) -> Outcome:
    conn = Raw(t, timeout=t.header_read_timeout + 10)
    try:
        # More bytes than the timeout lets through at this pace (and never a whole head).
        slow = b"a" * int((t.header_read_timeout + 5) / _TRICKLE_INTERVAL_S)
        _trickle(conn, b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Slow: " + slow, t.header_read_timeout + 5)
        return conn.wait_closed(5.0)
    finally:
        conn.close()


def _idle_connections(t: Target) -> Outcome:
    """`idle_connections` sockets that never send a byte: while they are open the server answers a normal request;
    then each must be closed (FIN) by the head timeout."""
    conns = [socket.create_connection((t.host, t.port), timeout=10) for _ in range(t.idle_connections)]
    try:
        t0 = time.monotonic()
        served = post(t, "/v1/completions", completion(t, prompt="still serving"))
        ready = get(t, "/health/ready")
        deadline = t0 + t.header_read_timeout + 10
        closed = reset = 0
        for c in conns:
            c.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                closed += c.recv(1) == b""
            except ConnectionResetError:
                reset += 1
            except TimeoutError:
                pass
        note = (
            f"{len(conns)} idle: a request meanwhile got {served.status} in {served.seconds * 1000:.0f} ms, "
            f"/health/ready {ready.status}; {closed} closed cleanly, {reset} reset"
        )
        ok = served.status == 200 and ready.status == 200 and closed == len(conns)
        return Outcome(status=None, closed=ok, reset=reset > 0, seconds=time.monotonic() - t0, note=note)
    finally:
        for c in conns:
            c.close()


def _garbage(t: Target) -> Outcome:
    conn = Raw(t)
    try:
        conn.send(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) + b"\r\n\r\n")
        return conn.response(timeout=10.0)
    finally:
        conn.close()


def _auth(kind: str) -> Callable[[Target], Outcome]:
    def run(t: Target) -> Outcome:
        if kind == "missing":
            return post(t, "/v1/completions", completion(t, prompt="hi"), auth=False)
        if kind == "wrong":
            return post(
                t,
                "/v1/completions",
                completion(t, prompt="hi"),
                auth=False,
                extra="Authorization: Bearer wrong-" + (t.api_key or ""),
            )
        if kind == "basic":
            return get(t, "/v1/models", auth=False, extra="Authorization: Basic dXNlcjpwYXNz")
        # A large unauthenticated body: refused from the head, never read.
        conn = Raw(t)
        try:
            n = min(t.max_body_bytes, 8 * 1024 * 1024)
            conn.send_body(head(t, "/v1/completions", n, auth=False), n, prefix=b'{"prompt": "')
            return conn.response()
        finally:
            conn.close()

    return run


def _open_path(path: str) -> Callable[[Target], Outcome]:
    return lambda t: get(t, path, auth=False)


def corpus(t: Target) -> list[Case]:
    """Every case for `t` (the API-key cases only when it has a key)."""
    cases = [
        Case("body over the limit (Content-Length)", "sizes", _over_limit_declared, 413, "request_too_large"),
        Case("100 MB body (Content-Length)", "sizes", _huge_declared, 413, "request_too_large"),
        Case("body over the limit (chunked)", "sizes", _over_limit_chunked, 413, "request_too_large"),
        Case("prompt as large as the body limit allows", "sizes", _prompt_cannot_fit, 400, "context_length_exceeded"),
        # Small bodies, parsed inline: refused by the characters bound (tiny models) or while tokenizing (pieces).
        Case(
            "200,000-character prompt",
            "sizes",
            _prompt_of("hello world ", lambda t: 200_000),
            400,
            "context_length_exceeded",
        ),
        Case(
            "prompt over max-model-len in tokens, not in characters",
            "sizes",
            _prompt_of("hello world ", lambda t: 12 * t.max_model_len),
            400,
            "context_length_exceeded",
        ),
        Case("64 KiB request header", "sizes", _huge_header, "4xx|closed"),
        Case("1,000 levels in an unknown field", "depths", _deep("unknown", 1000), 400, "json_too_deep"),
        Case("1,000 levels as the prompt", "depths", _deep("prompt", 1000), 400, "json_too_deep"),
        Case("1,000 levels as chat content", "depths", _deep("content", 1000), 400, "json_too_deep"),
        Case("100,000 levels", "depths", _deep("unknown", 100_000), 400, "json_too_deep"),
        Case("nesting exactly at the limit", "depths", _at_depth_limit, 200),
        Case("10,000 brackets inside a string", "depths", _brackets_in_strings, 200),
        Case("one token id more than --max-json-values", "depths", _many_values, 413, "too_many_values"),
        Case("as many commas inside a string", "depths", _commas_in_strings, 200),
        Case("lone surrogate in chat content", "encodings", _surrogate_in("content"), 400, "invalid_unicode"),
        Case("lone surrogate in the prompt", "encodings", _surrogate_in("prompt"), 400, "invalid_unicode"),
        Case("lone surrogate in stop", "encodings", _surrogate_in("stop"), 400, "invalid_unicode"),
        Case("lone surrogate in an unknown field", "encodings", _surrogate_in("x"), 400, "invalid_unicode"),
        Case("surrogate pair (valid)", "encodings", _valid_pair, 200),
        *malformed_body_cases(),
        Case("half a body, then silence", "slow", _half_body, 408, "request_timeout"),
        Case("a body trickled a byte at a time", "slow", _trickled_body, 408, "request_timeout"),
        Case("hang-up during the body", "slow", _hangup_during_body, CLOSED),
        Case("FIN during the body", "slow", _eof_during_body, "4xx|closed"),
        Case("hang-up during generation", "slow", _hangup_during(False), CLOSED),
        Case("hang-up mid-stream", "slow", _hangup_during(True), CLOSED),
        Case("a request head, half sent", "slow", _partial_head, CLOSED),
        Case("a request head trickled a byte at a time", "slow", _trickled_head, CLOSED),
        Case(f"{t.idle_connections} idle connections", "connections", _idle_connections, CLOSED),
        Case("not HTTP at all", "connections", _garbage, "4xx|closed"),
    ]
    if t.api_key:
        cases += [
            Case("no API key", "auth", _auth("missing"), 401, "invalid_api_key"),
            Case("wrong API key", "auth", _auth("wrong"), 401, "invalid_api_key"),
            Case("Basic credentials instead of a key", "auth", _auth("basic"), 401, "invalid_api_key"),
            Case("large body without a key", "auth", _auth("large"), 401, "invalid_api_key"),
            Case("/health/ready without a key", "auth", _open_path("/health/ready"), 200),
            Case("/metrics without a key", "auth", _open_path("/metrics"), 200),
        ]
    return cases


@dataclass
class CorpusResult:
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(1 for c in self.cases if c.outcome.status is not None and c.outcome.status >= 500)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "server_errors": self.server_errors,
            "cases": [
                {
                    "name": c.name,
                    "group": c.group,
                    "expected": c.expected,
                    "passed": c.passed,
                    "ok": c.ok,
                    "ready_after": c.ready_after,
                    "normal_after": c.normal_after,
                    **c.outcome.__dict__,
                }
                for c in self.cases
            ],
        }


def run_corpus(t: Target, progress: Callable[[str], None] | None = None, only: str | None = None) -> CorpusResult:
    """Every case in order, each followed by the health checks (READY, and a normal request that succeeds)."""
    say = progress or (lambda _m: None)
    result = CorpusResult()
    for case in corpus(t):
        if only is not None and only not in case.name:
            continue
        out = case.run(t)
        ready = get(t, "/health/ready", auth=False).status == 200
        normal = post(t, "/v1/completions", completion(t, prompt="a normal request")).status == 200
        expected = f"{case.expect}" + (f" {case.code}" if case.code else "")
        result.cases.append(CaseResult(case.name, case.group, expected, out, case.judge(out), ready, normal))
        say(
            f"hostile: {case.name}: {out.status or ('closed' if out.closed else 'reset' if out.reset else '?')} "
            f"({'ok' if result.cases[-1].passed else 'FAIL'})"
        )
    return result
