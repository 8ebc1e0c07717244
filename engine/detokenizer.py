"""Incremental detokenization that is correct across multi-byte UTF-8 characters, plus stop strings.

Byte-level BPE splits one character over several tokens; decoding such a prefix yields U+FFFD. We decode a short
window of already-emitted tokens together with the new ones and only emit once the window decodes cleanly, which
also keeps the leading-space behaviour of tokenizers that drop a space at the start of a decode.

Once text flows, the window before the new token is the single token emitted last. Two caches that are pure
functions of token ids, shared by the detokenizers of one tokenizer (`DecodeCache`), then spare the tokenizer calls:
- `pieces`: a token's text decoded alone (the window's text);
- `follows`: the text a token adds after any clean token. It is learned once per token id, and only kept when three
  different tokens before it (two fixed anchors and the token that was really there) give the same continuation, and
  it is clean UTF-8. A token whose continuation depends on what precedes it (a partial UTF-8 byte, a decoder that
  joins pieces) is marked and always decoded in its window.
With both, a token costs two dict lookups: at batch 64, the tokenizer calls were most of the decode step's host time,
since the model step before them leaves the tokenizer's tables out of the CPU caches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5
_ANCHOR_SEARCH = 4096  # token ids searched for the two anchors of `follows`


class DecodeCache:
    """The decodes that are pure functions of token ids, for one tokenizer and one skip_special_tokens setting
    (the engine keeps one per setting and hands it to every detokenizer)."""

    __slots__ = ("skip_special_tokens", "pieces", "follows", "anchors")

    def __init__(self, skip_special_tokens: bool) -> None:
        self.skip_special_tokens = skip_special_tokens
        self.pieces: dict[int, str] = {}
        # token -> its context-free continuation, or "" when it has none (context-dependent, empty, or not clean).
        self.follows: dict[int, str] = {}
        self.anchors: tuple[tuple[int, str], ...] | None = None  # (id, text) of two plain-word tokens, found once

    def find_anchors(self, decode: Callable[[list[int]], str]) -> tuple[tuple[int, str], ...]:
        if self.anchors is None:
            found: list[tuple[int, str]] = []
            for i in range(_ANCHOR_SEARCH):
                try:
                    text = decode([i])
                except Exception:  # noqa: BLE001 - an id the vocabulary lacks: not an anchor
                    continue
                if len(text) >= 2 and text.isascii() and text.isalpha() and text not in {t for _, t in found}:
                    found.append((i, text))
                    if len(found) == 2:
                        break
            self.anchors = tuple(found)
        return self.anchors


class IncrementalDetokenizer:
    # One per sequence, used every step: compact objects without a per-instance dict.
    __slots__ = (
        "tokenizer",
        "tokens",
        "prefix_offset",
        "read_offset",
        "skip_special_tokens",
        "stop",
        "_stop_reach",
        "_pieces",
        "_follows",
        "_cache",
        "_decode_list",
        "output_text",
        "stopped_by",
        "emitted",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        cache: DecodeCache | None = None,
    ) -> None:
        """`cache`: the decode cache to use, shared by every detokenizer of this tokenizer with the same
        skip_special_tokens (a private one if not given). A cache learned under the other setting is refused: its
        texts would keep (or drop) the special tokens this sequence drops (or keeps)."""
        if cache is not None and cache.skip_special_tokens != skip_special_tokens:
            raise ValueError(
                f"this DecodeCache holds texts decoded with skip_special_tokens={cache.skip_special_tokens}, but the"
                f" detokenizer decodes with skip_special_tokens={skip_special_tokens}; keep one cache per setting"
            )
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_token_ids)
        self.prefix_offset = max(len(self.tokens) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.tokens)
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self._stop_reach = max((len(s) for s in stop), default=0)  # longest stop string
        self._cache = DecodeCache(skip_special_tokens) if cache is None else cache
        self._pieces = self._cache.pieces
        self._follows = self._cache.follows
        # decode(ids, skip_special_tokens), positionally: glowplug's Tokenizer hands out its backend's method (no
        # Python frame per call); any other tokenizer (transformers', in tests) is called through its decode().
        self._decode_list: Callable[[list[int], bool], str] = getattr(tokenizer, "decode_list", tokenizer.decode)
        self.output_text = ""
        self.stopped_by: str | None = None
        self.emitted = 0  # characters already handed to a stream

    def _decode(self, ids: list[int]) -> str:
        return self._decode_list(ids, self.skip_special_tokens)

    def _window(self, start: int, stop: int) -> str:
        """The text of tokens[start:stop]; a single token's from the shared cache."""
        if stop - start != 1:
            return self._decode(self.tokens[start:stop])
        token = self.tokens[start]
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self._decode([token])
        return text

    def _advance(self, force: bool) -> str:
        prefix = self._window(self.prefix_offset, self.read_offset)
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and (force or not full.endswith(REPLACEMENT)):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full[len(prefix) :]
        return ""

    def append(self, token_id: int) -> bool:
        """Add one generated token; returns True when a stop string has ended the text."""
        tokens = self.tokens
        tokens.append(token_id)
        # _advance(force=False) inlined, with locals: this runs for every generated token of every sequence.
        start, read = self.prefix_offset, self.read_offset
        single = read - start == 1 and len(tokens) == read + 1
        prefix = self._pieces.get(tokens[start]) if single else None
        delta = self._follows.get(token_id) if prefix is not None and REPLACEMENT not in prefix else None
        if not delta:  # unknown, or no context-free continuation: decode the window
            if prefix is None:
                prefix = self._window(start, read)
            full = self._decode_list(tokens[start:], self.skip_special_tokens)
            if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
                return False
            delta = full[len(prefix) :]
            if single and token_id not in self._follows and full.startswith(prefix):
                self._learn(token_id, delta)
        self.prefix_offset, self.read_offset = read, len(tokens)
        if not self.stop:  # the common case, without _add_text's search
            self.output_text += delta
            return False
        return self._add_text(delta)

    def _learn(self, token_id: int, seen: str) -> None:
        """Record `token_id`'s continuation if the anchors give the same text as the token that preceded it here
        (`seen`), else mark it as having none."""
        follow = seen if REPLACEMENT not in seen else ""
        anchors = self._cache.find_anchors(self._decode)
        if len(anchors) < 2:
            follow = ""
        for anchor, text in anchors:
            if not follow:
                break
            full = self._decode([anchor, token_id])
            if not full.startswith(text) or full[len(text) :] != follow:
                follow = ""
        self._follows[token_id] = follow
        if follow and token_id not in self._pieces:  # the next token's window is this one: its text alone
            self._pieces[token_id] = self._decode([token_id])

    def flush(self) -> None:
        """At the end, emit whatever is pending even if it is not valid UTF-8 on its own."""
        if self.stopped_by is None and self.read_offset < len(self.tokens):
            delta = self._advance(force=True)
            if delta:
                self._add_text(delta)

    def _add_text(self, delta: str) -> bool:
        start = max(0, len(self.output_text) - self._stop_reach + 1)
        self.output_text += delta
        for s in self.stop:
            pos = self.output_text.find(s, start)
            if pos != -1:
                # The output ends exactly before the stop string.
                self.output_text = self.output_text[:pos]
                self.stopped_by = s
                return True
        return False

    def _holdback(self) -> int:
        """Characters at the end that could still grow into a stop string and must not be streamed yet."""
        text = self.output_text
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def take_stream_delta(self, finished: bool) -> str:
        """Text that is safe to stream now (everything, once finished)."""
        end = len(self.output_text) if finished or not self.stop else len(self.output_text) - self._holdback()
        if end <= self.emitted:
            return ""
        delta = self.output_text[self.emitted : end]
        self.emitted = end
        return delta
