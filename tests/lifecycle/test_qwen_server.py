"""Qwen2.5-Coder-1.5B-Instruct Q4_K_M, the official file (`glowplug models fetch qwen2.5-coder-1.5b`; skipped,
naming that command, until it is fetched), served by one real server for the module: its default start
(`--quantization auto`, the file's blocks in place; no compile, whose cost is not these tests') reaches READY, then
the openai client fills in the middle of code with the model's FIM tokens and calls tools through Qwen2.5's own
template (`auto`, `required` and a named tool)."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from lifecycle_harness import ThreadServer, engine_config
from tool_specs import ASK, TIME, WEATHER, check_calls

from glowplug.lifecycle.config import ServeConfig

pytestmark = pytest.mark.slow
GREEDY: dict[str, Any] = {"temperature": 0.0, "seed": 0}

# Small functions, each cut inside its body: the model fills the gap, and the whole must parse.
FIM_CASES = [
    ("def add(a, b):\n    return ", "\n\n\nprint(add(1, 2))\n"),
    ("def is_even(n):\n    ", "\n\n\nprint(is_even(4))\n"),
    ("def factorial(n):\n    if n <= 1:\n        return 1\n    ", "\n\n\nprint(factorial(5))\n"),
    ("def reverse(s):\n    return ", "\n\n\nprint(reverse('abc'))\n"),
    ("def maximum(xs):\n    best = xs[0]\n    for x in xs:\n        ", "\n    return best\n"),
    ("def count_vowels(s):\n    ", "\n    return total\n"),
    ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        ", "\n    return a\n"),
    ("def square_all(xs):\n    return [", "]\n\n\nprint(square_all([1, 2]))\n"),
    ("def greet(name):\n    ", "\n\n\ngreet('Ada')\n"),
    ("def mean(xs):\n    if not xs:\n        return 0.0\n    ", "\n\n\nprint(mean([1, 2, 3]))\n"),
]


@pytest.fixture(scope="module")
def coder(qwen_gguf: Path) -> Iterator[ThreadServer]:
    config = engine_config(qwen_gguf, compile="off", max_model_len=2048)
    assert config.quant.quantization == "auto"  # the default start: the file's blocks in place
    srv = ThreadServer(config, ServeConfig(port=0)).start()
    try:
        srv.wait_ready(timeout=600)
        yield srv
    finally:
        srv.stop()


def test_the_default_start_serves_the_file_under_its_name(coder: ThreadServer, qwen_gguf: Path) -> None:
    client = coder.client(timeout=300)
    assert [m.id for m in client.models.list().data] == [qwen_gguf.name]


def test_fill_in_the_middle_on_the_coder(coder: ThreadServer, qwen_gguf: Path) -> None:
    client = coder.client(timeout=300)

    def fill(i: int) -> Any:
        prefix, suffix = FIM_CASES[i]
        model = qwen_gguf.name if i % 2 == 0 else str(qwen_gguf)  # the path it was given as is accepted too
        return client.completions.create(model=model, prompt=prefix, suffix=suffix, max_tokens=48, **GREEDY)

    # All at once: they decode as one batch.
    with ThreadPoolExecutor(len(FIM_CASES)) as pool:
        outs = list(pool.map(fill, range(len(FIM_CASES))))
    fim = httpx.post(
        f"{coder.base_url}/tokenize", json={"prompt": "<|fim_prefix|>", "add_special_tokens": False}, timeout=60
    ).json()
    assert {out.model for out in outs} == {qwen_gguf.name}
    middles = [out.choices[0].text for out in outs]
    print("FIM middles:", json.dumps(middles))  # shown with -s: what the model wrote
    bad = []
    for (prefix, suffix), middle in zip(FIM_CASES, middles):
        try:
            ast.parse(prefix + middle + suffix)
        except SyntaxError as exc:
            bad.append((prefix, middle, suffix, str(exc)))
        if not middle.strip():  # some gaps parse empty (`return` alone): the model must write something
            bad.append((prefix, middle, suffix, "empty middle"))
    assert not bad, bad
    assert fim["count"] == 1


def test_tool_calls_auto_required_and_named(coder: ThreadServer, qwen_gguf: Path) -> None:
    """Qwen2.5's own template renders the tools; with tool_choice "auto" the model decides to call one (the Coder
    model writes `<tool_call>` or a fenced JSON object: the parser reads both). Forced calls: the grammar asks for
    Qwen's own <tool_call> tokens, which a matcher does not take as text."""
    client: openai.OpenAI = coder.client(timeout=300)
    model = qwen_gguf.name
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=48, **GREEDY
    )  # type: ignore[arg-type]
    # Parallel calls allowed (the default): after its call the 1.5B writes the newline that would start another,
    # then ends its turn, which the grammar must let it do rather than force a call after every newline.
    required = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=96, **GREEDY
    )  # type: ignore[arg-type]
    named = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        **GREEDY,
    )  # type: ignore[arg-type]
    assert out.choices[0].finish_reason == "tool_calls", out.choices[0]
    check_calls(out.choices[0].message.tool_calls, {"get_weather"})
    assert required.choices[0].finish_reason == "tool_calls", required.choices[0]
    check_calls(required.choices[0].message.tool_calls, {"get_weather", "get_time"})
    assert named.choices[0].finish_reason == "tool_calls", named.choices[0]
    check_calls(named.choices[0].message.tool_calls, {"get_time"})
