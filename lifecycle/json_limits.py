"""What a request body must satisfy around `json.loads`: a nesting depth it checks before parsing, and whole
Unicode characters in every string after.

Depth: Python's json parser recurses once per level and raises RecursionError near the interpreter's limit (a 2 KB
body of 1,000 `[` was a 500 with a 70 KB traceback). `nesting_exceeds` finds the first byte where the body goes
deeper than the limit, ignoring brackets inside strings, before anything is parsed: a body with no more opening
brackets than the limit is passed at the cost of two `bytes.count` calls (the normal request); any other is scanned
with numpy in 256 KiB chunks (no Python loop per byte: ~5 ms per MiB, and numpy releases the GIL in its loops).

Before parsing, also: the raw extent of a top-level string field (`top_level_string`) and a lower bound on its
length in characters (`min_chars`), so that a prompt too long to fit is refused without parsing it into a second
copy of itself (the body and its parsed string would hold it twice).

Unicode: RFC 8259 (section 8.2) leaves strings with unpaired surrogates (`"\\ud800"`) undefined, and the tokenizer
cannot take them (TypeError: 500). The body is decoded as strict UTF-8 (so no surrogate arrives as raw bytes); an
escaped lone surrogate is then searched for only when the text holds a `\\uD8..`-`\\uDF..` escape at all.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

# A request body as the server holds it: bytes, a bytearray, or a view of an anonymous mapping (transport.py).
Buffer = bytes | bytearray | memoryview

# Chunks of every scan here: its temporaries are a few arrays of this many elements (at most 1 MiB each, never a
# copy of the body), and no single numpy call holds the GIL for long.
_CHUNK = 1 << 18
_QUOTE, _BACKSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_OPEN = (ord("["), ord("{"))
_CLOSE = (ord("]"), ord("}"))
# `top_level_string` walks the body's strings in Python: only bodies made of few strings (one huge prompt, not a
# list of a million short ones) are looked at; others are parsed as they are.
_MAX_STRINGS = 2048
_WHITESPACE = b" \t\r\n"
# An escape for a UTF-16 surrogate (D800-DFFF). Pairs are legal; a hit only says that strings must be looked at.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _chunks(data: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    for start in range(0, len(data), _CHUNK):
        yield start, data[start : start + _CHUNK]


def _count(data: np.ndarray, test: Callable[[np.ndarray], np.ndarray]) -> int:
    return sum(int(np.count_nonzero(test(chunk))) for _, chunk in _chunks(data))


def _is_opener(chunk: np.ndarray) -> np.ndarray:
    return (chunk == _OPEN[0]) | (chunk == _OPEN[1])


def _is_closer(chunk: np.ndarray) -> np.ndarray:
    return (chunk == _CLOSE[0]) | (chunk == _CLOSE[1])


@dataclass(frozen=True)
class Excess:
    """Where a body first goes past a structural limit: `kind` "depth" (nesting) or "values" (elements)."""

    kind: str
    offset: int


def structure_exceeds(body: Buffer, max_depth: int, max_values: int | None = None) -> Excess | None:
    """The first place where `body` nests JSON arrays/objects deeper than `max_depth`, or (with `max_values`) holds
    more array elements and object members than that, counted by the commas between them; None if neither.

    Brackets and commas inside strings do not count (a backslash escapes the next byte). Backslashes outside
    strings are not JSON; a parser stops at the first one, before anything this scan could misjudge after it.
    Two counts over the bytes clear a body with no more opening brackets than `max_depth` and no more commas at all
    than `max_values` (every normal request); only the others are scanned."""
    data = np.frombuffer(body, dtype=np.uint8)
    check_depth = _count(data, _is_opener) > max_depth
    check_values = max_values is not None and _count(data, lambda chunk: chunk == _COMMA) >= max_values
    if not (check_depth or check_values):
        return None
    depth = 0  # at the end of the previous chunk
    values = 1  # elements and members so far: one more than the commas outside strings
    in_string = 0  # 1 while inside a string at the end of the previous chunk
    backslashes = 0  # length of the backslash run that ended the previous chunk
    for start, chunk in _chunks(data):
        n = len(chunk)
        positions = np.arange(n, dtype=np.int32)
        # For every byte, the position of the last byte at or before it that is not a backslash (-1: none in this
        # chunk); a quote is escaped when the backslash run right before it is odd.
        last_plain = np.maximum.accumulate(np.where(chunk == _BACKSLASH, np.int32(-1), positions))
        quotes = np.flatnonzero(chunk == _QUOTE)
        before = np.where(quotes > 0, last_plain[np.maximum(quotes - 1, 0)], -1)
        run = np.where(before >= 0, quotes - 1 - before, quotes + backslashes)
        real = quotes[(run & 1) == 0]
        toggles = np.zeros(n, dtype=np.int32)
        toggles[real] = 1
        outside = ((np.cumsum(toggles, dtype=np.int32) + in_string) & 1) == 0
        if check_depth:
            step = np.zeros(n, dtype=np.int32)
            step[_is_opener(chunk) & outside] = 1
            step[_is_closer(chunk) & outside] = -1
            levels = np.cumsum(step, dtype=np.int32) + depth
            if int(levels.max()) > max_depth:
                return Excess("depth", start + int(np.argmax(levels > max_depth)))
            depth = int(levels[-1])
        if check_values:
            assert max_values is not None
            commas = np.flatnonzero((chunk == _COMMA) & outside)
            if values + len(commas) > max_values:
                return Excess("values", start + int(commas[max_values - values]))
            values += len(commas)
        in_string = int(not outside[-1])
        tail = n - 1 - int(last_plain[-1])
        backslashes = backslashes + n if int(last_plain[-1]) < 0 else tail
    return None


def nesting_exceeds(body: Buffer, limit: int) -> int | None:
    """The offset of the first byte at which `body` nests JSON arrays/objects deeper than `limit`, or None."""
    excess = structure_exceeds(body, limit)
    return None if excess is None else excess.offset


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path, string) for every string in a parsed body, keys included (a key's path is its object's, with the key
    shown). Depth-first without recursion: the depth is already bounded, but a list costs no stack either way."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            yield where, item
        elif isinstance(item, dict):
            for key in item:
                yield f"{where or '(body)'} (a key)", key
            # Pushed in reverse, so that fields come off the stack in the order the client wrote them.
            stack.extend((f"{where}.{key}" if where else key, sub) for key, sub in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", sub) for i, sub in reversed(list(enumerate(item))))


def lone_surrogate(text: str, data: Any) -> tuple[str, int, str] | None:
    """(field path, character index, the surrogate) of the first string of `data` (parsed from `text`) holding a
    surrogate not paired into a character, or None."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return None
    for where, value in _strings(data, ""):
        found = _SURROGATE.search(value)
        if found is not None:
            return where, found.start(), found.group()
    return None


def _escaped(body: Buffer, quote: int, budget: list[int]) -> bool | None:
    """Whether the quote at `quote` is escaped (an odd run of backslashes before it); None once `budget` (bytes
    walked back, shared by the caller's calls) runs out."""
    i = quote - 1
    while i >= 0 and body[i] == _BACKSLASH:
        i -= 1
        budget[0] -= 1
        if budget[0] < 0:
            return None
    return (quote - 1 - i) % 2 == 1


def _next_non_space(body: Buffer, i: int) -> int:
    while i < len(body) and body[i] in _WHITESPACE:
        i += 1
    return i


def top_level_string(body: Buffer, key: bytes) -> tuple[int, int] | None:
    """The raw extent (start, end: between its quotes) of the string value of `key` in the top-level object of
    `body` (the last one, as json.loads keeps the last of duplicate keys), or None: no such string value, not a
    body of few strings, or not well-formed enough to tell (the parser will say why)."""
    data = np.frombuffer(body, dtype=np.uint8)
    if _count(data, lambda chunk: chunk == _QUOTE) > 2 * _MAX_STRINGS:
        return None
    budget = [1 << 16]
    quotes = []
    candidates = [start + int(i) for start, chunk in _chunks(data) for i in np.flatnonzero(chunk == _QUOTE)]
    for q in candidates:
        escaped = _escaped(body, q, budget)
        if escaped is None:
            return None
        if not escaped:
            quotes.append(q)
    if len(quotes) % 2:
        return None
    index_of = {q: i for i, q in enumerate(quotes)}
    found = None
    depth = 0
    prev_end = 0
    for open_, close in zip(quotes[0::2], quotes[1::2]):
        between = data[prev_end:open_]
        depth += _count(between, _is_opener) - _count(between, _is_closer)
        prev_end = close + 1
        # Lengths first: a huge value at depth 1 (the prompt itself) is never copied to be compared.
        if depth != 1 or close - open_ - 1 != len(key) or bytes(body[open_ + 1 : close]) != key:
            continue
        colon = _next_non_space(body, close + 1)
        if colon >= len(body) or body[colon] != ord(":"):
            continue
        # The value is a string when the next byte is a quote that opens one (an even index: quotes pair up).
        at = index_of.get(_next_non_space(body, colon + 1), -1)
        found = (quotes[at] + 1, quotes[at + 1]) if at >= 0 and at % 2 == 0 else None
    return found


def min_chars(body: Buffer, start: int, end: int) -> int:
    """A lower bound on the characters that the raw JSON string bytes body[start:end] decode to: every character
    starts with a byte that is not a UTF-8 continuation byte, and an escape (a backslash and at most 11 more
    bytes: `\\uD83D\\uDE80` is one character) stands for at least one."""
    seg = np.frombuffer(body, dtype=np.uint8)[start:end]
    leading = len(seg) - _count(seg, lambda chunk: (chunk & 0xC0) == 0x80)
    return max(0, leading - 6 * _count(seg, lambda chunk: chunk == _BACKSLASH))
