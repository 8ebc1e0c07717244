"""OpenAI response shapes: completion and chat bodies, their streaming chunks, usage and logprobs.

Pure formatting: nothing here touches the engine or the network, so the shapes can be checked in isolation.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from glowplug.engine.sequence import TokenLogprobs

Kind = Literal["completion", "chat"]


class TokenText:
    """Token id -> its text as a token of its own (for logprobs), cached: the same ids recur constantly."""

    def __init__(self, tokenizer: Any, limit: int = 65536) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._limit = limit

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < self._limit:
                self._cache[token_id] = text
        return text


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(lps: Sequence[TokenLogprobs], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """The legacy /v1/completions logprobs object; `offset` is where these tokens' text starts in the choice."""
    tokens: list[str] = []
    offsets: list[int] = []
    for lp in lps:
        offsets.append(offset)
        tok = text(lp.token_id)
        tokens.append(tok)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{text(t): v for t, v in lp.top.items()} for lp in lps],
        "text_offset": offsets,
    }


def _chat_token(token_id: int, logprob: float, text: TokenText) -> dict[str, Any]:
    tok = text(token_id)
    return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}


def chat_logprobs(lps: Sequence[TokenLogprobs], text: TokenText) -> dict[str, Any]:
    content = []
    for lp in lps:
        entry = _chat_token(lp.token_id, lp.logprob, text)
        entry["top_logprobs"] = [_chat_token(t, v, text) for t, v in lp.top.items()]
        content.append(entry)
    return {"content": content, "refusal": None}


@dataclass
class Choice:
    """One completion of a non-streamed response, gathered from the final RequestOutput."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI tool_calls of a chat message (text then holds the rest)


@dataclass
class ResponseHeader:
    """Fields every body and chunk of one response shares."""

    id: str
    model: str
    kind: Kind
    created: int = field(default_factory=lambda: int(time.time()))

    def _object(self, chunk: bool) -> str:
        if self.kind == "completion":
            return "text_completion"
        return "chat.completion.chunk" if chunk else "chat.completion"

    def body(
        self, choices: Sequence[Choice], text: TokenText, prompt_tokens: int, completion_tokens: int
    ) -> dict[str, Any]:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            if self.kind == "completion":
                lp = completion_logprobs(c.logprobs, text) if c.logprobs is not None else None
                out.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                lp = chat_logprobs(c.logprobs, text) if c.logprobs is not None else None
                message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
                if c.tool_calls:
                    message["content"] = c.text or None
                    message["tool_calls"] = c.tool_calls
                out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": c.finish_reason})
        return {
            "id": self.id,
            "object": self._object(chunk=False),
            "created": self.created,
            "model": self.model,
            "choices": out,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def chunk(
        self,
        index: int,
        *,
        delta: str | None,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
        role: bool = False,
        with_usage_field: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.kind == "completion":
            choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            d: dict[str, Any] = {}
            if role:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            if tool_calls is not None:
                d["tool_calls"] = tool_calls
            choice = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish_reason}
        out = {
            "id": self.id,
            "object": self._object(chunk=True),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if with_usage_field:
            out["usage"] = None  # OpenAI sends null on every chunk but the last when usage was asked for
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self._object(chunk=True),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }


# Code points that JSON may leave raw but that line splitters built on Python's str.splitlines (httpx's
# iter_lines, for one) take as line ends, cutting an event's JSON in two; escaped, they are still valid JSON.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (non-ASCII text stays UTF-8, not escaped)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload.translate(_LINE_BREAKERS)}\n\n".encode()


SSE_DONE = sse("[DONE]")
