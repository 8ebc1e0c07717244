"""The OpenAI-compatible API of a real server (uvicorn on 127.0.0.1, tiny model), driven by the official client."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from lifecycle_harness import ThreadServer, engine_config, metric, metric_samples, paced_engine
from openai import AsyncOpenAI

from glowplug.lifecycle.config import ServeConfig
from glowplug.profiling.logs import configure_logging
from glowplug.profiling.names import REQUEST_SPAN, ReqAttr
from glowplug.profiling.tracing import Tracing, setup_tracing

GREEDY = {"temperature": 0.0}
LONG = {"ignore_eos": True}  # the tiny model's EOS would end some answers early; token counts must be exact


@pytest.fixture(scope="module")
def tracing() -> Iterator[Tracing]:
    t = setup_tracing("glowplug-test")
    yield t
    t.shutdown()


@pytest.fixture(scope="module")
def server(tiny_model: Path, tracing: Tracing) -> Iterator[ThreadServer]:
    srv = ThreadServer(
        engine_config(tiny_model), ServeConfig(port=0, max_queue=64, served_model_name="tiny"), tracing=tracing
    ).start()
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ThreadServer) -> openai.OpenAI:
    return server.client()


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_usage_and_determinism(client: openai.OpenAI, server: ThreadServer) -> None:
    prompt = "The scheduler mixes prefill chunks"
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, extra_body=LONG, **GREEDY)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, extra_body=LONG, **GREEDY)
    tok = server.service.engine_info.tokenizer
    assert first.object == "text_completion" and first.model == "tiny"
    assert first.usage.prompt_tokens == len(tok(prompt)["input_ids"])
    assert first.usage.completion_tokens == 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + 12
    assert first.choices[0].finish_reason == "length"
    assert first.choices[0].text and first.choices[0].text == again.choices[0].text


def test_stop_string_ends_text(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="Numbers 0 1 2", max_tokens=20, extra_body=LONG, **GREEDY)
    text = base.choices[0].text
    stop = text[4:7]
    assert len(stop) == 3
    cut = client.completions.create(
        model="tiny", prompt="Numbers 0 1 2", max_tokens=20, stop=[stop], extra_body=LONG, **GREEDY
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_chat_completion(client: openai.OpenAI, server: ThreadServer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7, extra_body=LONG, **GREEDY)
    from glowplug.engine.tokenizer import encode_chat

    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.usage.prompt_tokens == len(encode_chat(server.service.engine_info.tokenizer, messages))
    assert resp.usage.completion_tokens == 7


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="Each key and value block", max_tokens=24, extra_body=LONG, **GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "The quick brown fox"}], max_tokens=16)
    whole = client.chat.completions.create(extra_body=LONG, **kwargs, **GREEDY)
    chunks = list(client.chat.completions.create(stream=True, extra_body=LONG, **kwargs, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_n_greater_than_one(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="tiny", prompt="glowplug starts", n=3, max_tokens=10, temperature=1.0, seed=7, extra_body=LONG
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == 30
    assert len({c.text for c in resp.choices}) > 1  # different seeds per completion, so different samples

    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=LONG,
    )
    finished: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    assert finished == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 16


def test_batched_prompts_in_one_completion_request(client: openai.OpenAI) -> None:
    prompts = ["The scheduler", "Quantized weights"]
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, extra_body=LONG, **GREEDY)
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=6, extra_body=LONG, **GREEDY) for p in prompts
    ]
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)


def test_logprobs(client: openai.OpenAI) -> None:
    comp = client.completions.create(
        model="tiny", prompt="The quick", max_tokens=5, logprobs=3, extra_body=LONG, **GREEDY
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0.0 and 1 <= len(top) <= 3
        assert abs(max(top.values()) - chosen) < 1e-4  # greedy: the chosen token is the most likely one

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body=LONG,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0.0 for t in content)


def test_sixteen_concurrent_streams_count_their_tokens(server: ThreadServer) -> None:
    prompts = ["The scheduler", "A request may stop", "emoji like", "Numbers 0 1 2 3"]
    lengths = [8 + 3 * i for i in range(16)]

    async def one(client: AsyncOpenAI, i: int) -> tuple[int, str, int, int]:
        stream = await client.completions.create(
            model="tiny",
            prompt=prompts[i % 4],
            max_tokens=lengths[i],
            logprobs=0,  # one logprobs entry per generated token: counts tokens exactly, whatever the text
            stream=True,
            stream_options={"include_usage": True},
            extra_body=LONG,
            **GREEDY,
        )
        text, tokens, usage = "", 0, None
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
            usage = chunk.usage or usage
        assert usage is not None
        return i, text, tokens, usage.completion_tokens

    async def run_all() -> list[tuple[int, str, int, int]]:
        async with AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(run_all())
    for i, _text, streamed, usage_tokens in results:
        assert streamed == usage_tokens == lengths[i]
    # Batched with 15 others, a greedy stream says what the same request says alone.
    client = server.client()
    for i, text, _, _ in results[:4]:
        alone = client.completions.create(
            model="tiny", prompt=prompts[i % 4], max_tokens=lengths[i], extra_body=LONG, **GREEDY
        )
        assert text == alone.choices[0].text


BAD_REQUESTS = [
    # (route, body, expected param)
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"max_tokens": 5}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
]


@pytest.mark.parametrize(
    ("route", "body", "param"), BAD_REQUESTS, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_REQUESTS)]
)
def test_bad_request_names_the_field(server: ThreadServer, route: str, body: dict, param: str) -> None:
    with server.http() as http:
        resp = http.post(route, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert param.split("[")[0] in err["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_body_is_400(server: ThreadServer, raw: bytes) -> None:
    with server.http() as http:
        resp = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_json"


def test_too_long_states_both_numbers(server: ThreadServer, client: openai.OpenAI) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    n_prompt = len(server.service.engine_info.tokenizer(prompt)["input_ids"])
    max_len = server.service.engine_info.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=max_len)
    message = info.value.body["message"]
    assert f"({n_prompt})" in message and f"({max_len})" in message
    assert info.value.body["code"] == "context_length_exceeded"


def test_unknown_fields_are_ignored(server: ThreadServer) -> None:
    with server.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": {"a": 1}})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1


def test_server_survives_bad_requests(server: ThreadServer, client: openai.OpenAI) -> None:
    with server.http() as http:
        for _route, body, _param in BAD_REQUESTS:
            http.post(_route, json=body)
        http.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
        assert http.get("/health/ready").status_code == 200
    ok = client.completions.create(model="tiny", prompt="still there?", max_tokens=3, extra_body=LONG)
    assert ok.usage.completion_tokens == 3


def test_metrics_parse_and_count(server: ThreadServer, client: openai.OpenAI) -> None:
    before = metric_samples(server.base_url)
    client.completions.create(model="tiny", prompt="count me", max_tokens=5, extra_body=LONG)
    after = metric_samples(server.base_url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("glowplug_generation_tokens_total") == 5
    assert delta("glowplug_prompt_tokens_total") >= 1
    for hist in (
        "glowplug_time_to_first_token_seconds",
        "glowplug_time_per_output_token_seconds",
        "glowplug_e2e_request_latency_seconds",
        "glowplug_request_queue_time_seconds",
    ):
        assert delta(f"{hist}_count") == 1, hist
    assert delta("glowplug_request_finished_total", finish_reason="length") == 1
    for gauge in ("glowplug_num_requests_running", "glowplug_num_requests_waiting", "glowplug_kv_cache_usage_ratio"):
        assert (gauge, ()) in after
    assert after[("glowplug_kv_cache_total_blocks", ())] == 512
    phases = {dict(labels)["phase"] for (name, labels) in after if name == "glowplug_startup_phase_duration_seconds"}
    assert {"tokenizer_init", "load_weights", "warmup"} <= phases
    assert after[("glowplug_engine_state", (("glowplug_engine_state", "ready"),))] == 1


@pytest.fixture
def paced_server(tiny_model: Path) -> Iterator[ThreadServer]:
    """A server of its own whose steps take at least 10 ms: a long answer is still generating when its client leaves,
    however fast this machine decodes the tiny model (unpaced, 900 tokens took under a second)."""
    srv = ThreadServer(engine_config(tiny_model), ServeConfig(port=0), engine_factory=paced_engine(0.01)).start()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_disconnect_mid_stream_frees_kv_blocks(paced_server: ThreadServer) -> None:
    url = paced_server.base_url
    aborted_before = metric(url, "glowplug_request_finished_total", finish_reason="abort")
    generated_before = metric(url, "glowplug_generation_tokens_total")
    body = {"prompt": "The scheduler", "max_tokens": 900, "stream": True, "ignore_eos": True, "temperature": 0.0}
    with httpx.Client(base_url=url, timeout=30.0) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [line for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")]
            assert got
            assert metric(url, "glowplug_kv_cache_used_blocks") > 0
        # Leaving the block closes the connection: the client is gone.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(url, "glowplug_kv_cache_used_blocks") > 0:
        time.sleep(0.02)
    assert metric(url, "glowplug_kv_cache_used_blocks") == 0
    assert metric(url, "glowplug_kv_cache_usage_ratio") == 0
    assert metric(url, "glowplug_request_finished_total", finish_reason="abort") == aborted_before + 1
    assert metric(url, "glowplug_generation_tokens_total") - generated_before < 900


def test_disconnect_while_waiting_for_a_whole_answer_aborts_it(paced_server: ThreadServer) -> None:
    # The client gives up after 0.3 s, while the paced answer is still generating.
    url = paced_server.base_url
    aborted_before = metric(url, "glowplug_request_finished_total", finish_reason="abort")
    body = {"prompt": "The scheduler", "max_tokens": 1000, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=httpx.Timeout(30.0, read=0.3)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body)  # gives up and closes the connection mid-generation
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        metric(url, "glowplug_request_finished_total", finish_reason="abort") == aborted_before
        or metric(url, "glowplug_kv_cache_used_blocks") > 0
    ):
        time.sleep(0.02)
    assert metric(url, "glowplug_request_finished_total", finish_reason="abort") == aborted_before + 1
    assert metric(url, "glowplug_kv_cache_used_blocks") == 0


def test_request_span_continues_traceparent_and_access_log(server: ThreadServer, tracing: Tracing) -> None:
    buf = io.StringIO()
    configure_logging(level="info", json=True, stream=buf)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "x-request-id": "req-test-42"}
    with server.http() as http:
        resp = http.post(
            "/v1/completions", json={"prompt": "trace me", "max_tokens": 4, "ignore_eos": True}, headers=headers
        )
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "req-test-42"

    def ours() -> list:
        return [
            s
            for s in tracing.finished_spans()
            if s.name == REQUEST_SPAN and s.attributes.get("glowplug.request_id") == "req-test-42"
        ]

    deadline = time.monotonic() + 5
    while not ours() and time.monotonic() < deadline:
        time.sleep(0.02)
    (span,) = ours()
    assert format(span.context.trace_id, "032x") == trace_id
    assert span.parent is not None and format(span.parent.span_id, "016x") == parent_id
    attrs = span.attributes
    assert attrs[ReqAttr.COMPLETION_TOKENS] == 4
    assert attrs[ReqAttr.PROMPT_TOKENS] == resp.json()["usage"]["prompt_tokens"]
    assert attrs[ReqAttr.FINISH_REASON] == "length"
    assert 0.0 <= attrs[ReqAttr.QUEUE_TIME_S] <= attrs[ReqAttr.TTFT_S]

    deadline = time.monotonic() + 5
    access = []
    while not access and time.monotonic() < deadline:
        lines = [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]
        access = [r for r in lines if r.get("event") == "http request" and r.get("request_id") == "req-test-42"]
        time.sleep(0.02)
    (line,) = access
    assert line["status"] == 200 and line["path"] == "/v1/completions"
    assert line["trace_id"] == trace_id and line["completion_tokens"] == 4
