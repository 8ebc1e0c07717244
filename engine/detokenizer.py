"""Incremental detokenization that is correct across multi-byte UTF-8 characters, plus stop strings.

Byte-level BPE splits one character over several tokens; decoding such a prefix yields U+FFFD. We decode a short
window of already-emitted tokens together with the new ones and only emit once the window decodes cleanly, which
also keeps the leading-space behaviour of tokenizers that drop a space at the start of a decode.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_token_ids)
        self.prefix_offset = max(len(self.tokens) - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.tokens)
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.output_text = ""
        self.stopped_by: str | None = None
        self.emitted = 0  # characters already handed to a stream

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, force: bool) -> str:
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and (force or not full.endswith(REPLACEMENT)):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full[len(prefix) :]
        return ""

    def append(self, token_id: int) -> bool:
        """Add one generated token; returns True when a stop string has ended the text."""
        self.tokens.append(token_id)
        delta = self._advance(force=False)
        if delta:
            return self._add_text(delta)
        return False

    def flush(self) -> None:
        """At the end, emit whatever is pending even if it is not valid UTF-8 on its own."""
        if self.stopped_by is None and self.read_offset < len(self.tokens):
            delta = self._advance(force=True)
            if delta:
                self._add_text(delta)

    def _add_text(self, delta: str) -> bool:
        start = max(0, len(self.output_text) - max((len(s) for s in self.stop), default=0) + 1)
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
        end = len(self.output_text) if finished else len(self.output_text) - self._holdback()
        if end <= self.emitted:
            return ""
        delta = self.output_text[self.emitted : end]
        self.emitted = end
        return delta
