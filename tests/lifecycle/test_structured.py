"""Structured outputs and tool calls through the openai client against real servers, plus the sampler's masking
against a reference and the tool-call parser's streaming against its whole-text result.

Most requests run on the tiny random-weight model: its output is noise, so a valid result is the grammar's doing
alone, and it decodes fast. The tool call that must make sense runs on the default model (SmolLM2, whose chat
template takes no tools: the server describes them in the system message, lifecycle/tool_calls.py)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import torch
from lifecycle_harness import ThreadServer, engine_config
from tool_specs import ASK, TIME, WEATHER, check_calls

from glowplug.engine.sampler import apply_token_bitmask
from glowplug.lifecycle.config import ServeConfig
from glowplug.lifecycle.tool_calls import ToolCallParser

GREEDY = {"temperature": 0.0, "seed": 0}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


# ------------------------------------------------------------------------------------------------ units
def test_masks_apply_to_constrained_rows_only() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 6, 1000
    logits = torch.randn(rows, vocab, generator=gen)
    constrained = [1, 4]
    rng = np.random.default_rng(0)
    allowed = rng.random((len(constrained), vocab)) < 0.05
    words = (vocab + 31) // 32
    bitmask = np.zeros((len(constrained), words), dtype=np.uint32)
    for j in range(len(constrained)):
        for t in np.flatnonzero(allowed[j]):
            bitmask[j, t // 32] |= np.uint32(1 << (t % 32))
    before = logits.clone()
    apply_token_bitmask(logits, bitmask.view(np.int32), constrained)
    for r in range(rows):
        if r not in constrained:
            assert torch.equal(logits[r], before[r]), "an unconstrained row was touched"
    for j, r in enumerate(constrained):
        ref = torch.where(torch.from_numpy(allowed[j]), before[r], torch.tensor(float("-inf")))
        assert torch.equal(logits[r], ref)
        assert int(logits[r].argmax()) == int(ref.argmax()) and allowed[j][int(logits[r].argmax())]
    # Logits wider than the mask (a model vocabulary past the tokenizer's): the columns past it are excluded.
    wide = torch.randn(1, 40)
    apply_token_bitmask(wide, np.array([[-1]], dtype=np.int32), [0])
    assert torch.isinf(wide[0, 32:]).all() and torch.isfinite(wide[0, :32]).all()


def _masked_fill_reference(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> torch.Tensor:
    """The sampler's first masking (unpack the allowed bits, one masked_fill per row): the oracle for the fast one."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(np.ascontiguousarray(bitmask[: len(rows)]).view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[-1] < vocab:
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[-1])))
    banned = torch.from_numpy(bits[:, :vocab] == 0)
    for j, row in enumerate(rows):
        logits[row].masked_fill_(banned[j], float("-inf"))
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_bitmask_apply_matches_the_masked_fill_reference(dtype: torch.dtype) -> None:
    """Random masks (dense, sparse, all-banned rows), vocabularies whose tail is not a multiple of 32 and ones wider
    than the mask, constrained rows in any order or all of them: the same logits as the reference, bit for bit."""
    rng = np.random.default_rng(1)
    for case in range(40):
        batch = int(rng.integers(1, 9))
        vocab = int(rng.integers(1, 400))
        words = (vocab + 31) // 32 - (1 if case % 5 == 4 and vocab > 32 else 0)  # some masks narrower than the logits
        rows = sorted(rng.choice(batch, size=int(rng.integers(1, batch + 1)), replace=False).tolist())
        if case % 3 == 0:
            rng.shuffle(rows)
        density = [0.5, 0.02, 0.0, 1.0][case % 4]
        allowed = rng.random((len(rows), words * 32)) < density
        bitmask = np.packbits(allowed, axis=-1, bitorder="little").view(np.int32)
        logits = torch.from_numpy(rng.standard_normal((batch, vocab)) * 4).to(dtype)
        want = _masked_fill_reference(logits.clone(), bitmask, rows)
        got = apply_token_bitmask(logits.clone(), bitmask, rows)
        assert torch.equal(got, want), (case, batch, vocab, words, rows)


def test_streamed_tool_calls_reassemble_to_the_whole_parse() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris {x}"}}\n</tool_call>'
    )
    whole = ToolCallParser()
    whole.feed(text)
    whole.finish()
    assert [c.name for c in whole.calls] == ["get_weather", "get_time"]
    assert json.loads(whole.calls[1].arguments) == {"zone": "Europe/Paris {x}"}
    rnd = random.Random(0)
    for _ in range(50):
        parser = ToolCallParser()
        cuts = sorted(rnd.sample(range(1, len(text)), 12))
        names: dict[int, str] = {}
        args: dict[int, str] = {}
        content = ""
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            for ev in (parser.feed(text[a:b]),):
                content += ev.content
                for i, call in ev.new_calls:
                    assert i not in args, "the name comes first"
                    names[i], args[i] = call.name, ""
                for i, piece in ev.arguments:
                    args[i] += piece
        end = parser.finish()
        content += end.content
        for i, piece in end.arguments:
            args[i] += piece
        assert content == whole.content
        assert [names[i] for i in sorted(names)] == [c.name for c in whole.calls]
        assert [args[i] for i in sorted(args)] == [c.arguments for c in whole.calls]


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```',
        ' {"name": "get_time", "parameters": {"zone": "UTC"}}',
    ],
)
def test_a_reply_of_one_json_call_is_a_call(text: str) -> None:
    for pieces in ([text], [text[:5], text[5:9], text[9:]]):
        parser = ToolCallParser(["get_time"])
        events = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert not any(e.content for e in events)
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_time", {"zone": "UTC"})]
    other = ToolCallParser(["get_weather"])  # not an offered function: the reply stays text
    other.feed(text)
    other.finish()
    assert other.content == text and not other.calls


# ------------------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ThreadServer]:
    srv = ThreadServer(engine_config(tiny_model, compile="off"), ServeConfig(port=0, served_model_name="smol")).start()
    srv.wait_ready(timeout=120)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ThreadServer) -> openai.OpenAI:
    return server.client(timeout=120)


@pytest.fixture(scope="module")
def smol() -> Iterator[openai.OpenAI]:
    srv = ThreadServer(engine_config("smollm2", compile="off"), ServeConfig(port=0, served_model_name="smol")).start()
    srv.wait_ready(timeout=300)
    yield srv.client(timeout=120)
    srv.stop()


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Invent a person and describe them as JSON."}]
    chat = client.chat.completions.create(
        model="smol", messages=messages, response_format=fmt, max_tokens=120, **GREEDY
    )  # type: ignore[arg-type]
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), PERSON)
    # The completions endpoint takes the same field, and vLLM's guided_* names are another way to ask.
    comp = client.completions.create(
        model="smol", prompt="A person as JSON:", max_tokens=120, extra_body={"guided_json": PERSON}, **GREEDY
    )
    jsonschema.validate(json.loads(comp.choices[0].text), PERSON)
    choice = client.completions.create(
        model="smol",
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]},
        temperature=1.0,
        seed=3,
    )
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=10**9)

    messages = [{"role": "user", "content": "Describe Paris."}]
    out = client.chat.completions.parse(model="smol", response_format=City, max_tokens=80, messages=messages, **GREEDY)  # type: ignore[arg-type]
    assert isinstance(out.choices[0].message.parsed, City)


def test_length_mid_object_is_length_not_an_error(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = client.chat.completions.create(model="smol", messages=ASK, max_tokens=4, **GREEDY, response_format=fmt)  # type: ignore[arg-type]
    assert out.choices[0].finish_reason == "length"
    assert '{"name": "'.startswith(out.choices[0].message.content or "-")


@pytest.mark.slow
def test_required_tool_choice_on_the_default_model(smol: openai.OpenAI) -> None:
    # One call (parallel_tool_calls false): the grammar ends the reply after it.
    req = smol.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=48,
        **GREEDY,
    )  # type: ignore[arg-type]
    assert req.choices[0].finish_reason == "tool_calls"
    calls = req.choices[0].message.tool_calls
    check_calls(calls, {"get_weather", "get_time"})
    assert calls is not None and calls[0].function.name == "get_weather"


def test_named_tool_choice(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    one = client.chat.completions.create(
        model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=100, **GREEDY
    )  # type: ignore[arg-type]
    calls = one.choices[0].message.tool_calls
    check_calls(calls, {"get_time"})
    assert calls is not None and len(calls) == 1 and one.choices[0].finish_reason == "tool_calls"
    # The call and its result go back through the template, and the model answers in text.
    follow = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "14:05"},
    ]
    back = client.chat.completions.create(
        model="smol", messages=follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=4, **GREEDY
    )  # type: ignore[arg-type]
    assert back.choices[0].message.tool_calls is None and back.choices[0].finish_reason in ("stop", "length")
    alone = client.chat.completions.create(model="smol", messages=ASK, max_tokens=1, **GREEDY)  # type: ignore[arg-type]
    assert back.usage is not None and alone.usage is not None and back.usage.prompt_tokens > alone.usage.prompt_tokens


def test_streamed_tool_calls_match_the_whole_response(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="smol", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=100, **GREEDY
    )
    whole = client.chat.completions.create(**kwargs)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id and d.function and d.function.name, "a call's first delta carries its id and name"
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
            elif d.function and d.function.arguments:
                calls[d.index]["arguments"] += d.function.arguments
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.choices[0].message.tool_calls or ()
    ]
    assert [calls[i] for i in sorted(calls)] == expected and expected
    assert finish == "tool_calls"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format.json_schema.schema",
            "strin",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "required",
        ),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "only one"),
        ({"guided_regex": "a("}, "guided_regex", "regex"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not one of the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ],
)
def test_bad_constraints_are_400s(server: ThreadServer, body: dict[str, Any], param: str, words: str) -> None:
    r = httpx.post(
        server.base_url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=30
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
