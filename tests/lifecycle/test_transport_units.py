"""The transport limits without a server: the JSON depth scan against a byte-by-byte reference, the lone-surrogate
search, body parsing errors, and the settings (flags, the API key kept out of every echo)."""

from __future__ import annotations

import argparse
import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import glowplug.lifecycle.json_limits as json_limits
from glowplug.base.flags import explain
from glowplug.lifecycle.config import API_KEY_ENV, ServeConfig, add_serve_flags, serve_config_from_args
from glowplug.lifecycle.errors import ApiError
from glowplug.lifecycle.json_limits import lone_surrogate, nesting_exceeds
from glowplug.lifecycle.protocol import CompletionRequest, parse_body


def reference_values(body: bytes, limit: int) -> int | None:
    """Byte by byte: the comma outside strings at which the elements/members (commas + 1) first exceed `limit`."""
    values, inside, i = 1, False, 0
    while i < len(body):
        c = body[i]
        if c == 0x5C:
            i += 2 if i + 1 < len(body) and body[i + 1] in (0x22, 0x5C) else 1
            continue
        if c == 0x22:
            inside = not inside
        elif not inside and c == 0x2C:
            values += 1
            if values > limit:
                return i
        i += 1
    return None


@pytest.mark.parametrize("chunk", [5, 1 << 18])
def test_value_count_matches_the_reference(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_limits, "_CHUNK", chunk)
    rnd = random.Random(chunk)
    for _ in range(2000):
        body = bytes(rnd.choice(b',,"\\ a[') for _ in range(rnd.randint(0, 60)))
        limit = rnd.randint(1, 8)
        expected = reference_values(body, limit)
        excess = json_limits.structure_exceeds(body, 10**6, limit)
        assert (excess.offset if excess is not None else None) == expected, (body, limit)


def reference_depth(body: bytes, limit: int) -> int | None:
    """Byte by byte: where the structure first goes deeper than `limit` (a backslash escapes a quote or a
    backslash after it; brackets inside strings do not count)."""
    depth, inside, i = 0, False, 0
    while i < len(body):
        c = body[i]
        if c == 0x5C:
            i += 2 if i + 1 < len(body) and body[i + 1] in (0x22, 0x5C) else 1
            continue
        if c == 0x22:
            inside = not inside
        elif not inside and c in b"[{":
            depth += 1
            if depth > limit:
                return i
        elif not inside and c in b"]}":
            depth -= 1
        i += 1
    return None


@pytest.mark.parametrize("chunk", [3, 7, 64, 1 << 18])
def test_depth_scan_matches_the_reference_across_chunk_boundaries(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_limits, "_CHUNK", chunk)
    rnd = random.Random(chunk)
    alphabet = b'[]{}"\\ a,'
    for _ in range(2000):
        body = bytes(rnd.choice(alphabet) for _ in range(rnd.randint(0, 80)))
        limit = rnd.randint(0, 6)
        expected = reference_depth(body, limit)
        if body.count(b"[") + body.count(b"{") <= limit:
            expected = None  # the fast path: too few openers to go deeper
        assert nesting_exceeds(body, limit) == expected, (body, limit)


def test_depth_scan_on_real_bodies() -> None:
    assert nesting_exceeds(b'{"prompt": "hi"}', 1) is None
    assert nesting_exceeds(b'{"a": [[1]]}', 2) == 7
    assert nesting_exceeds(b"[" * 1000 + b"]" * 1000, 128) == 128
    # Brackets inside strings, escaped quotes and escaped backslashes.
    body = json.dumps({"prompt": '[[[["[[[\\' * 100, "x": [[1]]}).encode()
    assert nesting_exceeds(body, 3) is None and nesting_exceeds(body, 2) is not None
    assert json.loads(body)["x"] == [[1]]


@given(
    st.recursive(
        st.none() | st.integers() | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c), max_leaves=30
    )
)
@settings(max_examples=200, deadline=None)
def test_depth_scan_agrees_with_the_parsed_depth(value: object) -> None:
    def depth(v: object) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

    body = json.dumps(value, ensure_ascii=False).encode()
    d = depth(value)
    assert nesting_exceeds(body, d) is None
    if d > 0:
        assert nesting_exceeds(body, d - 1) is not None


def test_lone_surrogates_are_found_and_named() -> None:
    text = '{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "stop": ["\\udbff"]}'
    assert lone_surrogate(text, json.loads(text)) == ("messages[0].content", 3, "\ud800")
    text = '{"prompt": "rocket \\ud83d\\ude80 \\\\ud800"}'  # a pair, and an escaped backslash before "ud800"
    assert lone_surrogate(text, json.loads(text)) is None
    text = '{"\\udc00": 1}'
    assert lone_surrogate(text, json.loads(text)) == ("(body) (a key)", 0, "\udc00")


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b"[" * 200 + b"]" * 200, "json_too_deep", None),
        (b'{"prompt": [' + b"1," * 2000 + b"1]}", "too_many_values", None),
        (b'{"prompt": "\xff"}', "invalid_json", None),
        (b'{"prompt": "\xed\xa0\x80"}', "invalid_json", None),  # a surrogate encoded as UTF-8 bytes
        (b'{"prompt": "a \\ud800"}', "invalid_unicode", "prompt"),
        (b'{"prompt": "a", "stop": ["\\udfff"]}', "invalid_unicode", "stop[0]"),
        (b'{"prompt": ', "invalid_json", None),
    ],
)
def test_parse_body_refuses_with_a_400(body: bytes, code: str, param: str | None) -> None:
    with pytest.raises(ApiError) as info:
        parse_body(CompletionRequest, bytearray(body), 128, 2000)
    status = 413 if code == "too_many_values" else 400
    assert info.value.status == status and info.value.code == code and info.value.param == param


def test_parse_body_empties_the_buffer_it_decoded() -> None:
    raw = bytearray(b'{"prompt": "hello"}')
    assert parse_body(CompletionRequest, raw, 128).prompt == "hello"
    assert len(raw) == 0


def test_transport_flags_come_from_the_schema() -> None:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(
        [
            "--max-body-bytes",
            "1024",
            "--max-json-depth",
            "16",
            "--body-read-timeout",
            "2.5",
            "--header-read-timeout",
            "0",
            "--api-key",
            "sk-flag",
            "--max-json-values",
            "4096",
        ]
    )
    cfg = serve_config_from_args(args)
    assert cfg.max_json_values == 4096
    assert (cfg.max_body_bytes, cfg.max_json_depth, cfg.body_read_timeout, cfg.header_read_timeout) == (
        1024,
        16,
        2.5,
        0.0,
    )
    assert cfg.api_key is not None and cfg.api_key.get_secret_value() == "sk-flag"
    defaults = ServeConfig()
    assert defaults.max_body_bytes == 16 << 20 and defaults.max_json_depth == 128 and defaults.api_key is None
    with pytest.raises(ValidationError):
        ServeConfig(max_json_depth=1000)  # past what Python's parser can take


def test_api_key_from_the_environment_and_never_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    monkeypatch.setenv(API_KEY_ENV, "sk-from-env")
    cfg = serve_config_from_args(parser.parse_args([]))
    assert cfg.api_key is not None and cfg.api_key.get_secret_value() == "sk-from-env"
    for shown in (repr(cfg), str(cfg), json.dumps(cfg.model_dump(mode="json"))):
        assert "sk-from-env" not in shown
    # The flag wins over the environment.
    assert serve_config_from_args(parser.parse_args(["--api-key", "sk-x"])).api_key.get_secret_value() == "sk-x"
    with pytest.raises(ValidationError) as info:
        ServeConfig(api_key="has space secret")
    assert "has space secret" not in str(info.value) and "has space secret" not in explain(info.value)
    assert "--api-key" in explain(info.value)


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(st.sampled_from(["prompt", "x", "model"]) | st.text(max_size=4), c, max_size=3)
    ),
    max_leaves=12,
)


@given(
    st.dictionaries(st.sampled_from(["prompt", "model", "x", "stop"]) | st.text(max_size=6), _JSON_VALUES, max_size=4),
    st.booleans(),
    st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_the_raw_prompt_is_found_and_its_length_bounded(
    body: dict[str, object], ascii_only: bool, pretty: bool
) -> None:
    raw = json.dumps(body, ensure_ascii=ascii_only, indent=2 if pretty else None).encode()
    span = json_limits.top_level_string(raw, b"prompt")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        assert span is None
        return
    assert span is not None
    assert json.loads(b'"' + raw[span[0] : span[1]] + b'"') == prompt
    assert json_limits.min_chars(raw, *span) <= len(prompt)


def test_min_chars_is_exact_for_plain_text() -> None:
    raw = json.dumps({"model": "m", "prompt": "hello world " * 1000, "max_tokens": 2}).encode()
    span = json_limits.top_level_string(raw, b"prompt")
    assert span is not None and json_limits.min_chars(raw, *span) == 12_000
    # A body of many strings is not walked (it is parsed as it is).
    many = json.dumps({"prompt": "p", "x": ["s"] * 5000}).encode()
    assert json_limits.top_level_string(many, b"prompt") is None


@given(
    st.dictionaries(st.sampled_from(["prompt", "model", "x", "stop"]) | st.text(max_size=6), _JSON_VALUES, max_size=4),
    st.booleans(),
    st.booleans(),
    st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30),
    st.sampled_from([3, 16, 1 << 18]),
)
@settings(max_examples=400, deadline=None)
def test_the_prompt_scan_bounds_every_prefix_and_ends_at_the_whole_prompts_bound(
    body: dict[str, object], ascii_only: bool, pretty: bool, cuts: list[int], chunk: int
) -> None:
    """Fed the body piece by piece (as it arrives), the scan's bound never passes the prompt's real length in
    characters, and once the body is in it is the bound read from the whole body (0 when the prompt is no
    string)."""
    raw = json.dumps(body, ensure_ascii=ascii_only, indent=2 if pretty else None).encode()
    prompt = body.get("prompt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(json_limits, "_CHUNK", chunk)
        scan = json_limits.PromptScan(b"prompt")
        end = 0
        for cut in cuts:
            end = min(len(raw), end + cut)
            bound = scan.feed(memoryview(raw)[:end])
            assert bound <= (len(prompt) if isinstance(prompt, str) else 0)
        final = scan.feed(raw)
    span = json_limits.top_level_string(raw, b"prompt")
    assert final == (json_limits.min_chars(raw, *span) if span is not None else 0)


def test_the_prompt_scan_on_bodies_that_arrive_in_pieces() -> None:
    head = b'{"model": "m", "stop": ["\\"", "x"], "prompt": "'
    scan = json_limits.PromptScan(b"prompt")
    assert scan.feed(head) == 0
    body = head + "héllo wörld ".encode() * 10_000
    assert scan.feed(body[: len(head) + 6]) == 5  # "héllo": 6 bytes
    assert scan.feed(body) == 120_000  # characters, not bytes
    # An escaped quote does not end the prompt; the real one does, and nothing after it counts.
    body += b'\\" and more", "max_tokens": 5, "x": "' + b"y" * 1000
    assert scan.feed(body) == 120_000 + len(b'\\" and more') - 6  # an escape counts as one character at least
    assert scan.feed(body + b'"}') == scan.chars
    # The prompt one level down, or as a value of another key, is not the prompt.
    for other in (b'{"x": {"prompt": "' + b"a" * 100, b'{"x": "prompt", "y": "' + b"a" * 100):
        assert json_limits.PromptScan(b"prompt").feed(other) == 0


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_the_prompt_scan_carries_backslash_runs_across_pieces(chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_limits, "_CHUNK", chunk)
    for k in range(7):
        prompt = "\\" * k + '"' + "ab" * 200 + "\\" * k  # a bound above 0 for every k
        raw = json.dumps({"x": ['\\"', "\\"], "prompt": prompt, "y": "z"}).encode()
        span = json_limits.top_level_string(raw, b"prompt")
        assert span is not None
        for step in (1, 4, 7):
            scan = json_limits.PromptScan(b"prompt")
            for end in range(step, len(raw) + step, step):
                scan.feed(raw[:end])
            assert scan.chars == json_limits.min_chars(raw, *span) > 0, (k, step)
