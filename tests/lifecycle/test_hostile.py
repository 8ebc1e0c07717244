"""The hostile-transport corpus against one real server (uvicorn on 127.0.0.1, tiny model, real sockets).

Beside test_fuzz.py (schemathesis: valid shapes, generated): here the bytes a hostile or broken client sends (sizes,
depths, encodings, slow and truncated bodies and heads, hundreds of idle connections, API keys). Every case must
end in a 4xx (or a clean close, or 200 for the valid boundary cases), with the server READY and a normal request
succeeding after it; no 5xx, no traceback in the logs, the key in no log line, and each client fault counted.
The limits are small here (a 4 MiB body, 1 s timeouts) so that the corpus runs in about 15 s.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from lifecycle_harness import ThreadServer, engine_config, metric, paced_engine

from glowplug.engine.tokenizer import max_token_chars
from glowplug.lifecycle.config import ServeConfig
from glowplug.lifecycle.state import EngineState
from glowplug.profiling.bench.serve.hostile_corpus import Raw, Target, head, run_corpus
from glowplug.profiling.logs import configure_logging
from glowplug.profiling.names import Metric

KEY = "sk-glowplug-hostile-test-0123456789"
LIMITS = {"max_body_bytes": 4 << 20, "body_read_timeout": 1.0, "header_read_timeout": 1.0}


@pytest.fixture
def logs() -> io.StringIO:
    """Everything the server logs during one test, as JSON lines (conftest resets structlog after each test; the
    server's loggers are not cached, so they follow)."""
    stream = io.StringIO()
    configure_logging(level="info", json=True, stream=stream)
    return stream


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ThreadServer]:
    cfg = ServeConfig(port=0, served_model_name="tiny", api_key=KEY, **LIMITS)
    # Eager (no compile): the corpus is about the transport, and the server starts in seconds. Paced steps: a client
    # that hangs up mid-answer must find the answer still streaming, however fast this machine decodes.
    srv = ThreadServer(engine_config(tiny_model, compile="off"), cfg, engine_factory=paced_engine(0.005)).start()
    srv.wait_ready()
    yield srv
    srv.stop()


def _target(srv: ThreadServer) -> Target:
    cfg = srv.serve_cfg
    return Target(
        host="127.0.0.1",
        port=int(srv.server.bound_port),
        model="tiny",
        api_key=KEY,
        max_body_bytes=cfg.max_body_bytes,
        max_json_depth=cfg.max_json_depth,
        max_json_values=cfg.max_json_values,
        body_read_timeout=cfg.body_read_timeout,
        header_read_timeout=cfg.header_read_timeout,
        max_model_len=srv.service.engine_info.max_model_len,
        idle_connections=300,
    )


def test_openai_client_with_the_right_key_a_wrong_key_and_none(server: ThreadServer) -> None:
    url = server.base_url + "/v1"

    def ask(key: str | None) -> openai.types.Completion:
        # No key: the SDK insists on one, so it is given one and told to send no Authorization header at all.
        client = openai.OpenAI(base_url=url, api_key=key or "unused", max_retries=0)
        headers = {"Authorization": openai.Omit()} if key is None else None
        return client.completions.create(model="tiny", prompt="hello", max_tokens=2, extra_headers=headers)

    assert ask(KEY).choices[0].finish_reason in ("length", "stop")
    for key in ("sk-wrong", None):
        with pytest.raises(openai.AuthenticationError) as info:
            ask(key)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        assert "invalid_api_key" in info.value.response.text and "sk-wrong" not in info.value.response.text
    # The OpenAPI document says so (clients generated from it send the key); it stays open itself.
    doc = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    post = doc["paths"]["/v1/completions"]["post"]
    assert post["security"] == [{"bearer": []}] and {"401", "408", "413"} <= set(post["responses"])
    assert "security" not in doc["paths"]["/health/ready"]["get"]
    # /tokenize and /detokenize take request content: the key guards them as it guards /v1.
    assert doc["paths"]["/tokenize"]["post"]["security"] == [{"bearer": []}]
    tokenize = httpx.post(server.base_url + "/tokenize", json={"prompt": "hello"}, timeout=30)
    assert tokenize.status_code == 401 and tokenize.json()["error"]["code"] == "invalid_api_key"
    keyed = httpx.post(
        server.base_url + "/tokenize", json={"prompt": "hello"}, timeout=30, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert keyed.status_code == 200 and keyed.json()["count"] >= 1
    # Probes, metrics, /startup and the page stay open; the key is echoed by none of them.
    for path in ("/health/live", "/health/ready", "/metrics", "/startup", "/"):
        resp = httpx.get(server.base_url + path, timeout=30)
        assert resp.status_code == 200, path
        assert KEY not in resp.text, path


class _Records(logging.Handler):
    """stdlib log records at WARNING and above (uvicorn's own lines, such as "Exception in ASGI application")."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_corpus_ends_in_4xx_or_a_clean_close_and_a_healthy_server(server: ThreadServer, logs: io.StringIO) -> None:
    stdlib = _Records()
    logging.getLogger().addHandler(stdlib)
    try:
        _run_corpus_and_check(server, logs, stdlib)
    finally:
        logging.getLogger().removeHandler(stdlib)


def _run_corpus_and_check(server: ThreadServer, logs: io.StringIO, stdlib: _Records) -> None:
    before = {
        stage: metric(server.base_url, Metric.CLIENT_DISCONNECTS + "_total", stage=stage)
        for stage in ("body", "response")
    }
    result = run_corpus(_target(server))
    failed = [(c.name, c.expected, c.outcome, c.ready_after, c.normal_after) for c in result.cases if not c.passed]
    assert not failed, failed
    assert result.server_errors == 0 and len(result.cases) >= 35
    assert server.service.snapshot().state is EngineState.READY
    # The requests whose clients hung up were aborted, not left generating for nobody.
    deadline = time.monotonic() + 30
    while metric(server.base_url, "glowplug_num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server.base_url, "glowplug_num_requests_running") == 0

    # Client faults are counted, by stage; a refused request by its reason.
    base = server.base_url
    assert metric(base, Metric.CLIENT_DISCONNECTS + "_total", stage="body") >= before["body"] + 2
    assert metric(base, Metric.CLIENT_DISCONNECTS + "_total", stage="response") >= before["response"] + 2
    assert metric(base, Metric.CONNECTIONS_TIMED_OUT + "_total") >= 300 + 2
    for reason in (
        "body_too_large",
        "body_timeout",
        "json_too_deep",
        "invalid_unicode",
        "unauthorized",
        "head_too_large",
        "too_many_values",
    ):
        assert metric(base, Metric.REQUEST_REJECTED + "_total", reason=reason) >= 1, reason

    # No traceback and no error line anywhere: a client's fault is an info line on its request's access log.
    text = logs.getvalue()
    for bad in ("Traceback", "unhandled error", '"level": "error"', "Exception in ASGI application"):
        assert bad not in text, bad
    assert not [r.getMessage() for r in stdlib.records if r.levelno >= logging.ERROR or r.exc_info]
    assert KEY not in text and not [r for r in stdlib.records if KEY in r.getMessage()]
    disconnects = [line for line in text.splitlines() if '"client_disconnected"' in line]
    assert disconnects and all('"level": "info"' in line and '"request_id"' in line for line in disconnects)


def test_a_prompt_proven_too_long_is_refused_before_the_rest_of_its_body(server: ThreadServer) -> None:
    """Against the served tokenizer: a prompt at the characters bound is tokenized and answered; one character
    past it is refused while its body arrives (the client has sent a few KB of a 3 MiB body), and the server stays
    READY."""
    info = server.service.engine_info
    longest, limit = max_token_chars(info.tokenizer), info.max_model_len
    assert longest is not None
    vocab = info.tokenizer.backend.get_vocab(with_added_tokens=True)
    widest = info.tokenizer.decode([vocab[max(vocab, key=len)]])  # a token that covers `longest` characters
    assert len(widest) == longest
    # Padding after the prompt makes the body large enough to be watched as it arrives.
    pad = "a" * (3 << 20)
    auth = {"Authorization": f"Bearer {KEY}"}

    def complete(prompt: str) -> httpx.Response:
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0.0, "prompt": prompt, "x": pad}
        with server.http() as http:
            return http.post("/v1/completions", json=body, headers=auth)

    # Each copy of the widest token is one token: `limit - 4` of them and 4 more tokens fill the context exactly.
    fits = complete(widest * (limit - 4))
    assert fits.status_code == 200, fits.text
    assert fits.json()["usage"]["prompt_tokens"] == limit - 4
    # `limit` of them are exactly at the characters bound: not refused by it, but tokenized and refused by their
    # counted tokens and max_tokens.
    counted = complete(widest * limit)
    assert counted.status_code == 400 and counted.json()["error"]["code"] == "context_length_exceeded"
    assert f"prompt tokens ({limit}) + max_tokens (4)" in counted.json()["error"]["message"]
    # One character more proves it too long: refused before the client sends the rest of its body.
    t = _target(server)
    whole = json.dumps({"model": "tiny", "max_tokens": 4, "prompt": "b" * (limit * longest + 1), "x": pad}).encode()
    sent = whole.index(b'"x"')
    conn = Raw(t, timeout=10)
    try:
        conn.send(head(t, "/v1/completions", len(whole)) + whole[:sent])
        out = conn.response()
        assert (out.status, out.code) == (400, "context_length_exceeded"), out
        assert f"at least {limit * longest + 1:,} characters" in out.note, out.note
        assert conn.wait_closed(5.0).closed  # the rest is not waited for: the connection closes
    finally:
        conn.close()
    assert server.service.snapshot().state is EngineState.READY
    again = complete("hello")
    assert again.status_code == 200, again.text
