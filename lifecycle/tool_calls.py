"""Tool calls in the Qwen/Hermes syntax: the grammar that forces them, the prompt for templates without tools, and
the parser that turns generated text into OpenAI `tool_calls`, streamed or whole.

The model writes each call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5's and
Hermes' templates teach it that). With tool_choice "required" or a named function the output is held to that
syntax by a grammar (engine/structured.py), so the calls always parse; with "auto" the model may write text, calls,
or both, and the parser finds the calls. Streaming and whole responses run the same parser (`ToolCallParser`), so a
streamed call reassembles to exactly the call a non-streamed response returns: its id and name come first, then its
arguments as fragments of the model's own text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from glowplug.engine.structured import lark_grammar

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
# The start of a call's JSON up to its arguments' value (its first character seen, so that the whitespace before it
# is settled): the name is known (and sent) once this matched.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# A whole reply that is one JSON object in a markdown fence.
_FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)
# What the grammar asks of the call's JSON (and what Qwen writes): separators with one space, nothing else.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call of any of `tools` (OpenAI function specs): name first, then its arguments."""
    options = []
    for tool in tools:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    one = {"anyOf": options} if len(options) > 1 else options[0]
    return {**one, "x-guidance": _JSON_STYLE}


def tool_grammar(tools: Sequence[dict[str, Any]], parallel: bool, tags: tuple[int, int] | None = None) -> str:
    """The grammar of one or more calls (`parallel`) of `tools`, and nothing else. `tags`: the token ids of OPEN and
    CLOSE where the vocabulary has each as one token (tag_token_ids): the grammar then asks for those tokens, since
    a matcher does not take a special token as the text it spells; without them, the tags as text."""
    schema = json.dumps(call_schema(tools))
    # After a call a model may write the newline that would separate another one and then end its turn: the
    # newline alone must not force another call (greedy decoding would then call again and again).
    start = 'start: call ("\\n" call)* "\\n"?' if parallel else "start: call"
    opening, closing = (f"<[{tags[0]}]>", f"<[{tags[1]}]>") if tags else (f'"{OPEN}"', f'"{CLOSE}"')
    return lark_grammar(f'{start}\ncall: {opening} "\\n" %json {schema} "\\n" {closing}\n')


def tag_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ids of OPEN and CLOSE when `tokenizer` encodes each as one token (Qwen2.5's added tokens), else None."""
    from glowplug.engine.tokenizer import PromptTooLong, encode_bounded

    try:
        ids = [encode_bounded(tokenizer, tag, limit=64, add_special_tokens=False) for tag in (OPEN, CLOSE)]
    except PromptTooLong:
        return None
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def tools_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """How a model whose chat template takes no tools is told about them: the Hermes-style system text Qwen2.5's
    template writes, so the same parser reads the answer."""
    specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{specs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f'{OPEN}{CLOSE} XML tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}'
    )


def render_call(name: str, arguments: str) -> str:
    """An earlier assistant call as the model writes it (for templates without tools)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParseEvents:
    """What one feed produced: content text, new calls (their index, id and name), argument fragments by index."""

    content: str = ""
    new_calls: list[tuple[int, ToolCall]] = field(default_factory=list)
    arguments: list[tuple[int, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.new_calls or self.arguments)


def _arguments(body: str, head_end: int) -> str:
    """The arguments' text of a call body: from after the head to its last '}' (the call object's own), trimmed.
    A prefix of the body gives a prefix of the final value, which is what lets them stream."""
    end = body.rfind("}")
    return body[head_end:end].rstrip() if end >= head_end else ""


class ToolCallParser:
    """Splits generated text into content and tool calls as it arrives (see the module docstring).

    `names`: the functions offered. A reply that is nothing but one JSON object `{"name": <one of them>,
    "arguments" (or "parameters"): {...}}`, bare or in a ```json fence (what Llama 3 writes, and Qwen2.5-Coder
    often does instead of `<tool_call>`), is read as that call too; such a reply is held back until it ends."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.names = frozenset(names)
        self.calls: list[ToolCall] = []
        self.content = ""
        self._pending = ""  # text not yet classified: a possible start of OPEN, or the current call's body
        self._in_call = False
        self._head_end: int | None = None
        self._sent = 0  # argument characters of the current call already handed out

    def feed(self, text: str) -> ParseEvents:
        ev = ParseEvents()
        self._pending += text
        while True:
            if not self._in_call:
                at = self._pending.find(OPEN)
                if at < 0 and self._maybe_json_call():
                    return ev
                if at < 0:
                    keep = _partial_suffix(self._pending, OPEN)
                    self._emit_content(ev, self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    return ev
                self._emit_content(ev, self._pending[:at])
                self._pending = self._pending[at + len(OPEN) :]
                self._in_call, self._head_end, self._sent = True, None, 0
            close = self._pending.find(CLOSE)
            body = self._pending if close < 0 else self._pending[:close]
            self._advance_call(ev, body)
            if close < 0:
                return ev
            self._end_call(ev, body)
            self._pending = self._pending[close + len(CLOSE) :].lstrip("\n")

    def finish(self) -> ParseEvents:
        """The end of the text: a call left open (the length limit) ends with what it has."""
        ev = ParseEvents()
        if self._in_call:
            self._advance_call(ev, self._pending)
            self._end_call(ev, self._pending)
        elif not self._json_call(ev, self._pending):
            self._emit_content(ev, self._pending)
        self._pending = ""
        return ev

    def _maybe_json_call(self) -> bool:
        """Could the reply so far be a whole-reply JSON call (nothing sent yet, and it opens like one)?"""
        if not self.names or self.content or self.calls:
            return False
        head = self._pending.lstrip()
        return head.startswith(("{", "```")) or "```".startswith(head)

    def _json_call(self, ev: ParseEvents, text: str) -> bool:
        if not self.names or self.content or self.calls:
            return False
        m = _FENCED.fullmatch(text)
        try:
            obj = json.loads(m.group(1) if m else text)
        except ValueError:
            return False
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if not isinstance(args, dict) or obj.get("name") not in self.names or len(obj) != 2:
            return False
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        ev.new_calls.append((len(self.calls) - 1, ToolCall(call.id, call.name)))
        ev.arguments.append((len(self.calls) - 1, call.arguments))
        return True

    def _emit_content(self, ev: ParseEvents, text: str) -> None:
        if text:
            ev.content += text
            self.content += text

    def _advance_call(self, ev: ParseEvents, body: str) -> None:
        if self._head_end is None:
            m = _HEAD.match(body)
            if m is None:
                return
            self._head_end = m.end()
            call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", json.loads(f'"{m.group(1)}"'))
            self.calls.append(call)
            ev.new_calls.append((len(self.calls) - 1, call))
        self._send_arguments(ev, _arguments(body, self._head_end))

    def _send_arguments(self, ev: ParseEvents, args: str) -> None:
        if len(args) > self._sent:
            piece = args[self._sent :]
            self.calls[-1].arguments += piece
            ev.arguments.append((len(self.calls) - 1, piece))
            self._sent = len(args)

    def _end_call(self, ev: ParseEvents, body: str) -> None:
        if self._head_end is None:
            # Not a call this parser can read (no name first): it stays text, as the model wrote it.
            self._emit_content(ev, OPEN + body)
        self._in_call = False


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (held back: it may become a tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
