"""What clients send besides prompts and sampling, through the openai client (or plain HTTP where the client has no
method) against a real server on the default model: logit_bias, echo, suffix (fill in the middle), /tokenize,
/detokenize, /health, /version, the served model's name, and the bad inputs of constrained decoding.

One server for the module (SmolLM2, no compile); fill in the middle runs on Qwen2.5-Coder-1.5B (test_qwen_server.py:
its vocabulary has the FIM tokens; SmolLM2's does not)."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from lifecycle_harness import ThreadServer, engine_config

from glowplug.engine.sampler import sample
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.sequence import RunnerSeq
from glowplug.lifecycle.config import ServeConfig

GREEDY: dict[str, Any] = {"temperature": 0.0}
PROMPT = "The capital of France is"


# ------------------------------------------------------------------------------------------------ units
def _runner_seq(i: int, params: SamplingParams) -> RunnerSeq:
    return RunnerSeq(
        seq_id=i,
        request_id=f"r{i}",
        prompt_token_ids=[1],
        output_token_ids=[],
        params=params,
        sample_key=i + 1,
        block_table=[],
        num_computed_tokens=1,
    )


def test_logit_bias_moves_only_its_rows() -> None:
    """A batch mixing biased and plain rows: the plain rows sample what they sample alone (same tokens, same
    logprobs), a -100 token is never chosen, a +100 token always is, and the reported logprobs stay the model's."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen) * 4
    top = [int(t) for t in logits.argmax(-1)]
    plain = SamplingParams(temperature=0.0, logprobs=0)
    params = [
        plain,
        SamplingParams(temperature=0.0, logprobs=0, logit_bias={str(top[1]): -100}),
        SamplingParams(temperature=1.0, logit_bias={"7": 100}),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=0.0, logit_bias={str(top[4]): -100, "250": 100}),
    ]
    seqs = [_runner_seq(i, p) for i, p in enumerate(params)]
    out = sample(logits.clone(), seqs)
    alone = sample(logits[[0, 3]].clone(), [seqs[0], seqs[3]])
    assert out[0].token_id == top[0] == alone[0].token_id and out[3].token_id == alone[1].token_id
    assert out[0].logprobs == alone[0].logprobs
    assert out[1].token_id != top[1]
    assert out[1].token_id == int(torch.topk(logits[1], 2).indices[1])
    assert out[2].token_id == 7 and out[4].token_id == 250
    lp = torch.log_softmax(logits[1], -1)
    assert out[1].logprobs is not None and out[1].logprobs.logprob == pytest.approx(float(lp[out[1].token_id]))


def test_logit_bias_validation_names_the_problem() -> None:
    assert SamplingParams(logit_bias={"12": -100, "3": 0.5}).logit_bias == {12: -100.0, 3: 0.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad, words in (
        ({"x": 1}, "not a token id"),
        ({"-1": 1}, "not a token id"),
        ({"1": 100.5}, "outside"),
        ({"1": "5"}, "not a number"),
        ({"1": True}, "not a number"),
    ):
        with pytest.raises(ValueError, match=words):
            SamplingParams(logit_bias=bad)


def test_model_file_is_named_by_its_file_name(tmp_path: Path) -> None:
    gguf = tmp_path / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF")
    cfg = ServeConfig()
    assert cfg.model_name(str(gguf)) == gguf.name
    assert cfg.model_names(str(gguf)) == (gguf.name, str(gguf))
    assert cfg.model_name("smollm2") == "smollm2" and cfg.model_names("smollm2") == ("smollm2",)
    named = ServeConfig(served_model_name="coder")
    assert named.model_name(str(gguf)) == "coder" and named.model_names(str(gguf)) == ("coder",)


# ------------------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server() -> Iterator[ThreadServer]:
    srv = ThreadServer(engine_config("smollm2", compile="off"), ServeConfig(port=0)).start()
    srv.wait_ready(timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ThreadServer) -> openai.OpenAI:
    return server.client(timeout=120)


def _post(server: ThreadServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def _token_id(server: ThreadServer, text: str) -> int:
    tokens = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(tokens) == 1, (text, tokens)
    return int(tokens[0])


@pytest.mark.slow
def test_logit_bias_bans_and_forces_tokens(server: ThreadServer, client: openai.OpenAI) -> None:
    free = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, logprobs=0, **GREEDY)
    said = free.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert said and said[0] == " Paris"
    # Every token the free run wrote, banned: none of them comes back, and the first choice changes.
    banned = {_token_id(server, t) for t in set(said)}
    bias = {str(t): -100 for t in banned}
    held = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=8, logprobs=0, logit_bias=bias, **GREEDY
    )
    again = held.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert len(again) == 8 and not set(again) & set(said), (said, again)
    # +100 on one token: greedy writes nothing else, on both endpoints.
    banana = _token_id(server, " banana")
    forced = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=6, logit_bias={str(banana): 100}, **GREEDY
    )
    assert forced.choices[0].text == " banana" * 6
    chat = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logit_bias={str(banana): 100},
        **GREEDY,
    )
    assert chat.choices[0].message.content == " banana" * 4


@pytest.mark.parametrize(
    ("bias", "words"),
    [({"99999999": 5}, "outside the vocabulary"), ({"abc": 5}, "not a token id"), ({"5": -101}, "outside [-100")],
)
def test_bad_logit_bias_is_400_naming_it(server: ThreadServer, bias: dict[str, Any], words: str) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        r = _post(server, path, {**body, "max_tokens": 2, "logit_bias": bias})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and words in err["message"], err


@pytest.mark.slow
def test_echo_puts_the_prompt_first(server: ThreadServer, client: openai.OpenAI) -> None:
    plain = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, **GREEDY)
    echoed = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, echo=True, **GREEDY)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
    # Token-id prompts are echoed as their text; each prompt's completions get their own prompt.
    prompts = [_post(server, "/tokenize", {"prompt": p}).json()["tokens"] for p in ("Hello world", PROMPT)]
    ids = client.completions.create(model="smollm2", prompt=prompts, max_tokens=2, echo=True, n=2, **GREEDY)
    texts = [c.text for c in sorted(ids.choices, key=lambda c: c.index)]
    assert [t.startswith("Hello world") for t in texts] == [True, True, False, False]
    assert [t.startswith(PROMPT) for t in texts] == [False, False, True, True]


def test_echo_with_logprobs_and_suffix_without_fim_are_400s(server: ThreadServer) -> None:
    r = _post(server, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert "prompt tokens' logprobs" in r.json()["error"]["message"]
    r = _post(server, "/v1/completions", {"prompt": "def f(", "suffix": "\n", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "no fill-in-the-middle tokens" in r.json()["error"]["message"]


def test_tokenize_detokenize_health_version(server: ThreadServer, client: openai.OpenAI) -> None:
    out = _post(server, "/tokenize", {"model": "smollm2", "prompt": "Hello world"}).json()
    assert out == {"count": 2, "max_model_len": out["max_model_len"], "tokens": out["tokens"]}
    assert out["max_model_len"] == client.models.list().data[0].max_model_len  # type: ignore[attr-defined]
    assert _post(server, "/detokenize", {"tokens": out["tokens"]}).json() == {"prompt": "Hello world"}
    # Messages are rendered as a chat completion renders them: the same prompt tokens.
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = _post(server, "/tokenize", {"messages": messages, "return_token_strs": True}).json()
    done = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert done.usage is not None and chat["count"] == done.usage.prompt_tokens
    assert chat["token_strs"][0] == "<|im_start|>" and len(chat["token_strs"]) == chat["count"]
    for path, body, param in (
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
        ("/detokenize", {"tokens": "1"}, "tokens"),
        ("/tokenize", {"model": "other", "prompt": "a"}, "model"),
    ):
        r = _post(server, path, body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body, r.text)
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    version = httpx.get(server.base_url + "/version", timeout=10).json()
    assert version == {"version": importlib.metadata.version("glowplug")}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}}, "guided_json", "Unsatisfiable"),
        ({"guided_json": {"type": "string", "format": "no-such-format"}}, "guided_json", "no-such-format"),
        ({"guided_grammar": 'start: a\na: a "x"'}, "guided_grammar", "matches no output"),
    ],
)
def test_constraints_that_cannot_work_are_400s(
    server: ThreadServer, body: dict[str, Any], param: str, words: str
) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_unmatchable_grammar_streamed_is_an_error_naming_it(client: openai.OpenAI) -> None:
    # Streamed, the response has begun (200) when the engine refuses: the error event names the field.
    with pytest.raises(openai.APIError) as info:
        for _ in client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "x"}],
            max_tokens=4,
            stream=True,
            extra_body={"guided_grammar": 'start: b\nb: b "y"'},
        ):
            pass
    assert "guided_grammar: the grammar matches no output" in str(info.value)


@pytest.mark.slow
def test_length_mid_object_streamed_is_length(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "A name as JSON"}],
            max_tokens=3,
            stream=True,
            extra_body={"guided_json": schema},
            **GREEDY,
        )
    )  # type: ignore[call-overload]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert '{"name": "'.startswith(text) or text.startswith('{"name": "')
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
