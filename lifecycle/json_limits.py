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


class PromptScan:
    """Follows a body as it arrives, for a lower bound on the characters of the top-level string value of `key`
    received so far: so that a prompt too long to fit can be refused before the rest of its body is read.

    `feed(body)` scans the bytes added since the last call (the body so far, which only grows) with numpy, carrying
    the state of the scan (inside a string or not, the backslash run at the end, the nesting depth) from one call
    to the next; only the strings' quotes are looked at one by one. The first value of `key` counts (a body with
    duplicate keys has no defined meaning, RFC 8259 section 4). The scan gives up, and the bound stays 0, on a body
    of more than _MAX_STRINGS strings before the value, or with more than 256 bytes between the key and its value:
    such bodies are read whole and checked after (`top_level_string`)."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seen = 0  # bytes scanned
        self._backslashes = 0  # length of the backslash run that ends the scanned bytes
        self._open: int | None = None  # first byte of the string being read (None: outside strings)
        self._depth = 0  # nesting depth at `_outside`, outside strings
        self._outside = 0  # first byte after the last string (the non-string bytes from here are not counted yet)
        self._key_end: int | None = None  # the byte after the closing quote of `key` at depth 1, last string read
        self._strings = 0
        self._value: int | None = None  # where the value's characters are counted up to (None: not in the value)
        self._leading = 0  # bytes of the value that start a UTF-8 character
        self._escapes = 0  # backslashes in the value
        self._stopped = False

    @property
    def chars(self) -> int:
        """The lower bound so far: every character starts with a byte that is not a UTF-8 continuation byte, and an
        escape (at most 12 bytes with up to 2 backslashes) stands for at least one (as `min_chars`)."""
        return max(0, self._leading - 6 * self._escapes)

    def feed(self, body: Buffer) -> int:
        """Scan what `body` holds past the bytes scanned before; the bound (`chars`) after it."""
        if self._stopped or len(body) <= self._seen:
            return self.chars
        data = np.frombuffer(body, dtype=np.uint8)
        base = self._seen
        for start, chunk in _chunks(data[base:]):
            self._scan(data, base + start, chunk)
            self._seen = base + start + len(chunk)
            if self._stopped:
                break
        if self._value is not None and not self._stopped:
            self._count_value(data, len(data))
        return self.chars

    def _real_quotes(self, chunk: np.ndarray) -> np.ndarray:
        """Offsets in `chunk` of its quotes not escaped by a backslash run (carried over from the bytes before)."""
        n = len(chunk)
        quotes = np.flatnonzero(chunk == _QUOTE)
        if len(quotes) == 0:
            # Most of a long string: one pass, and the backslash run at the end looked at only when there is one.
            if chunk[-1] == _BACKSLASH:
                plain = np.flatnonzero(chunk != _BACKSLASH)
                self._backslashes = self._backslashes + n if len(plain) == 0 else n - 1 - int(plain[-1])
            else:
                self._backslashes = 0
            return quotes
        positions = np.arange(n, dtype=np.int32)
        last_plain = np.maximum.accumulate(np.where(chunk == _BACKSLASH, np.int32(-1), positions))
        before = np.where(quotes > 0, last_plain[np.maximum(quotes - 1, 0)], -1)
        run = np.where(before >= 0, quotes - 1 - before, quotes + self._backslashes)
        tail = int(last_plain[-1])
        self._backslashes = self._backslashes + n if tail < 0 else n - 1 - tail
        return quotes[(run & 1) == 0]

    def _count_value(self, data: np.ndarray, end: int) -> None:
        assert self._value is not None
        seg = data[self._value : end]
        self._leading += len(seg) - _count(seg, lambda chunk: (chunk & 0xC0) == 0x80)
        self._escapes += _count(seg, lambda chunk: chunk == _BACKSLASH)
        self._value = end

    def _scan(self, data: np.ndarray, offset: int, chunk: np.ndarray) -> None:
        for at in self._real_quotes(chunk):
            q = offset + int(at)
            if self._open is None:
                self._opening(data, q)
            else:
                self._closing(data, q)
            if self._stopped:
                return

    def _opening(self, data: np.ndarray, q: int) -> None:
        between = data[self._outside : q]
        self._depth += _count(between, _is_opener) - _count(between, _is_closer)
        self._open = q + 1
        if self._key_end is not None and self._depth == 1 and q - self._key_end <= 256:
            if bytes(data[self._key_end : q]).strip(_WHITESPACE) == b":":
                self._value = q + 1
        self._key_end = None

    def _closing(self, data: np.ndarray, q: int) -> None:
        assert self._open is not None
        if self._value is not None:
            self._count_value(data, q)
            self._stopped = True  # the whole value is in: its bound is final
            return
        self._strings += 1
        if self._strings > _MAX_STRINGS:
            self._stopped = True
            return
        opened, self._open = self._open, None
        self._outside = q + 1
        is_key = self._depth == 1 and q - opened == len(self._key) and bytes(data[opened:q]) == self._key
        self._key_end = q + 1 if is_key else None
