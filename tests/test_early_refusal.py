"""The early refusal of a prompt too long to fit, against SmolLM2's real tokenizer: the token count the server
derives from the part of a body received so far (`PromptScan`'s characters over the tokenizer's widest token)
never exceeds the prompt's real token count, so a refusal before tokenizing never refuses a prompt that fits."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glowplug.engine.tokenizer import load_tokenizer, max_token_chars
from glowplug.lifecycle.json_limits import PromptScan

# Pieces that reach the bound (the widest tokens: a newline and 80 spaces, 80 '#'), multi-byte characters, and
# the bytes JSON escapes (quotes, backslashes, control and line-separator characters).
_PIECES = [
    "\n" + " " * 80,
    "#" * 80,
    "=" * 65,
    " ",
    "\n",
    "hello",
    " world",
    "é",
    "🚀",
    "中文",
    '"',
    "\\",
    "\t",
    "\u2028",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.mark.slow
@given(
    st.lists(st.sampled_from(_PIECES), max_size=80),
    st.booleans(),
    st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=12),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_bound_from_a_body_prefix_never_passes_the_real_token_count(
    smollm2_tokenizer: Any, pieces: list[str], ascii_only: bool, cuts: list[int]
) -> None:
    longest = max_token_chars(smollm2_tokenizer)
    assert longest == 81
    prompt = "".join(pieces)
    tokens = len(smollm2_tokenizer.encode(prompt, add_special_tokens=False))
    raw = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}, ensure_ascii=ascii_only).encode()
    scan = PromptScan(b"prompt")
    end = 0
    for cut in [*cuts, len(raw)]:
        end = min(len(raw), end + cut)
        assert math.ceil(scan.feed(raw[:end]) / longest) <= tokens
