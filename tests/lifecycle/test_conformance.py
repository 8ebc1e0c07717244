"""OpenAI conformance of the error paths, checked with the official `openai` client against a real server: unknown
models are 404 model_not_found, a message without its content is a 400 naming `messages[0].content`, and every error
body has exactly the shape the client parses (error.message, type, param, code), whatever the status."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from lifecycle_harness import ThreadServer, engine_config, paced_engine

from glowplug.lifecycle.config import ServeConfig
from glowplug.lifecycle.openapi import ErrorResponse

LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ThreadServer]:
    srv = ThreadServer(engine_config(tiny_model), ServeConfig(port=0, served_model_name="tiny")).start()
    srv.wait_ready()
    yield srv
    srv.stop()


def assert_error_shape(exc: openai.APIStatusError, status: int) -> dict[str, Any]:
    """The body the client parsed: exactly {message, type, param, code}, and the client's attributes filled."""
    assert exc.status_code == status
    raw = exc.response.json()
    ErrorResponse.model_validate(raw)  # extra="forbid": no key more, none missing
    body = exc.body
    assert isinstance(body, dict) and body == raw["error"]
    assert isinstance(body["message"], str) and body["message"]
    assert exc.message.endswith(body["message"]) or body["message"] in exc.message
    assert exc.type == body["type"] and exc.code == body["code"] and exc.param == body["param"]
    return body


def test_unknown_model_is_404_model_not_found(server: ThreadServer) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    body = assert_error_shape(info.value, 404)
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "no-such-model" in body["message"] and "tiny" in body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}], stream=True)
    assert assert_error_shape(info.value, 404)["code"] == "model_not_found"
    # The served name works, and so does no model at all (the one served model is meant).
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=LONG)
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "system"}, {"role": "user", "content": "x"}],
    ],
    ids=["missing", "null", "system-missing"],
)
def test_message_without_content_is_400_naming_the_field(server: ThreadServer, messages: list[dict]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    body = assert_error_shape(info.value, 400)
    assert body["param"] == "messages[0].content"
    assert "messages[0].content" in body["message"]
    assert body["type"] == "invalid_request_error"


def test_assistant_turn_may_omit_content(server: ThreadServer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "again"}]
    resp = server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=3, extra_body=LONG)
    assert resp.usage.completion_tokens == 3


BAD = [
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": 11}, "temperature"),
    ("completions", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("completions", {"prompt": "x", "max_tokens": 100000}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 17}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD, ids=[f"{r}-{p}" for r, _, p in BAD])
def test_every_400_has_the_client_shape(server: ThreadServer, route: str, body: dict, param: str) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        if route == "completions":
            client.completions.create(model="tiny", **body)
        else:
            client.chat.completions.create(model="tiny", **body)
    assert assert_error_shape(info.value, 400)["param"] == param


def test_429_has_the_client_shape_and_retry_after(tiny_model: Path) -> None:
    # One sequence at a time and room for one waiting request: a third concurrent request is turned away.
    # Paced steps: the holders must still run when the third request comes, however fast this machine decodes.
    srv = ThreadServer(
        engine_config(tiny_model, max_num_seqs=1), ServeConfig(port=0, max_queue=1), engine_factory=paced_engine(0.01)
    ).start()
    try:
        srv.wait_ready()
        body = {"prompt": "hold", "max_tokens": 900, "ignore_eos": True, "stream": True}
        holders = [threading.Thread(target=_stream_quietly, args=(srv.base_url, body), daemon=True) for _ in range(2)]
        for t in holders:
            t.start()
            time.sleep(0.3)
        with pytest.raises(openai.RateLimitError) as info:
            srv.client().completions.create(model=srv.service.model_name, prompt="x", max_tokens=2)
        body_ = assert_error_shape(info.value, 429)
        assert body_["code"] == "queue_full" and body_["type"] == "rate_limit_error"
        assert int(info.value.response.headers["retry-after"]) >= 1
    finally:
        srv.stop()


def _stream_quietly(base_url: str, body: dict) -> None:
    try:
        with httpx.Client(base_url=base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as resp:
                for _ in resp.iter_lines():
                    pass
    except httpx.HTTPError:
        pass  # the server stopping at the end of the test cuts these off
