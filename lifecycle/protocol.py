"""OpenAI request bodies and their mapping onto the engine's one schema, SamplingParams.

The models here check only shapes and types (strictly: `"5"` is not a number, `"yes"` not a boolean); every range
and limit (temperature >= 0, top_p in (0, 1], at most 16 stop strings, ...) is SamplingParams' own validation, so
the HTTP API, the CLI and the offline API can never disagree. Unknown fields are ignored, as OpenAI does; known
OpenAI fields the engine cannot honour are refused with a 400 rather than silently dropped.

A sampling field the request leaves out takes the served model's default (engine/generation_config.py: its
generation config, else greedy), the one `glowplug generate` uses: `parse_body(..., defaults)` attaches them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.structured import (
    GrammarError,
    check_grammar,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)

from .errors import ApiError, bad_request, from_validation_error
from .json_limits import lone_surrogate, structure_exceeds
from .tool_calls import render_call, tool_grammar, tools_system_prompt
from .transport import BodyBuffer

# Default max_tokens of /v1/completions (OpenAI's); chat defaults to whatever the context has left.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


# Request fields that map one to one onto SamplingParams fields of the same name.
_PASSTHROUGH = (
    "n",
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "stop",
    "logit_bias",
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionSpec(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Body):
    name: str
    arguments: str


class ToolCallIn(_Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def _grammar_or_400(build: Any, param: str, fix: str) -> str:
    """`build()`'s grammar, checked; a 400 naming `param`, llguidance's reason and `fix` when it cannot be used."""
    try:
        grammar = build()
        check_grammar(grammar)
    except GrammarError as exc:
        raise bad_request(f"{param}: {str(exc).strip()}; {fix}", param, code="invalid_grammar") from None
    return grammar


class _SamplingFields(_Body):
    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Token id (a decimal string) -> bias in [-100, 100]: checked by SamplingParams, ids against the vocabulary.
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # vLLM-style extensions, named as in SamplingParams.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    # Structured outputs: OpenAI's response_format, and vLLM's guided_* fields (one of them per request).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # The grammar the fields above ask for (llguidance's text), built and checked by check().
    _grammar: str | None = PrivateAttr(default=None)
    # The served model's sampling defaults, for the fields this request leaves out (not a request field).
    _defaults: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    def _common_checks(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        self._grammar = self._structured_grammar()

    @property
    def grammar_param(self) -> str | None:
        """The field the request's output constraint comes from (what a refusal of its grammar by the engine, one
        that matches no output, names); None when the output is free."""
        if self._grammar is None:
            return None
        if getattr(self, "forced_tools", None):
            return "tools"
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return next(
            name
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, name) is not None
        )

    def _structured_grammar(self) -> str | None:
        """The grammar of response_format or the guided_* field the request sets (a 400 when it sets several, or
        one that cannot be used)."""
        rf = self.response_format
        given = [
            name
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, name) is not None
        ]
        if rf is not None and rf.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise bad_request(
                f"{', '.join(given)}: a request takes one output constraint; send only one of them", given[1]
            )
        if not given:
            return None
        fix = "see the README's structured outputs section for what is supported"
        if given[0] == "response_format":
            assert rf is not None
            if rf.type == "json_object":
                return _grammar_or_400(lambda: json_schema_grammar({"type": "object"}), "response_format", fix)
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request(
                    'response_format.json_schema.schema: required with {"type": "json_schema"}; '
                    "send the JSON schema the output must follow",
                    "response_format.json_schema",
                )
            schema = rf.json_schema.schema_
            return _grammar_or_400(
                lambda: json_schema_grammar(schema),
                "response_format.json_schema.schema",
                "fix the schema or drop the keywords named",
            )
        if given[0] == "guided_json":
            value = self.guided_json
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise bad_request(
                        f"guided_json: not valid JSON ({exc}); send the schema as an object", "guided_json"
                    ) from None
            return _grammar_or_400(lambda: json_schema_grammar(value), "guided_json", "fix the schema")  # type: ignore[arg-type]
        if given[0] == "guided_regex":
            regex = self.guided_regex or ""
            return _grammar_or_400(lambda: regex_grammar(regex), "guided_regex", "fix the regular expression")
        if given[0] == "guided_choice":
            choices = self.guided_choice or []
            if not choices or any(not c for c in choices):
                raise bad_request("guided_choice: needs at least one choice, none of them empty", "guided_choice")
            return _grammar_or_400(lambda: choice_grammar(choices), "guided_choice", fix)
        lark = self.guided_grammar or ""
        return _grammar_or_400(lambda: lark_grammar(lark), "guided_grammar", "fix the Lark grammar")

    def _sampling_fields(self) -> dict[str, Any]:
        given = {name: getattr(self, name) for name in _PASSTHROUGH if getattr(self, name) is not None}
        if self._grammar is not None:
            given["grammar"] = self._grammar
        return {**self._defaults, **given}


class CompletionRequest(_SamplingFields):
    # Tried in this order, first match wins: in pydantic's default "smart" mode a list of ids was also validated
    # against every other member, and 2^20 of them took 310 ms with the GIL held instead of 27 ms.
    prompt: str | list[int] | list[list[int]] | list[str] = Field(union_mode="left_to_right")
    logprobs: int | None = None
    echo: bool | None = False  # the prompt's text before the completion's
    best_of: int | None = None
    suffix: str | None = None  # fill in the middle: the text after the completion (the model's FIM tokens)

    def check(self) -> None:
        self._common_checks()
        if self.echo and self.logprobs is not None:
            # vLLM answers with the prompt tokens' logprobs; this engine computes logits for sampled positions only.
            raise bad_request(
                "echo: with logprobs it needs the prompt tokens' logprobs, which this server does not "
                "compute; send echo without logprobs, or logprobs without echo",
                "echo",
            )
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of: only best_of == n is supported", "best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt: must not be an empty list", "prompt")

    def sampling_params(self, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The request's params; `stop_token_ids` are added to its own (a fill-in-the-middle request's end tokens)."""
        fields = self._sampling_fields()
        if stop_token_ids:
            fields["stop_token_ids"] = (*fields.get("stop_token_ids", ()), *stop_token_ids)
        fields["max_tokens"] = self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
        return make_sampling_params(fields)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        self._common_checks()
        for i, message in enumerate(self.messages):
            # OpenAI lets only an assistant turn (one that made tool calls) go without content.
            if message.content is None and message.role != "assistant":
                raise bad_request(
                    f"messages[{i}].content: a {message.role} message needs content (a string or text parts)",
                    f"messages[{i}].content",
                    code="missing",
                )
        self._tool_checks()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")

    def _tool_checks(self) -> None:
        choice = self.tool_choice
        if not self.tools:
            if choice is not None and choice != "none":
                raise bad_request(
                    "tool_choice: needs tools; send the tools it may call, or drop tool_choice", "tool_choice"
                )
            return
        names = [t.function.name for t in self.tools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise bad_request(f"tools: function names must be unique ({', '.join(sorted(dup))} repeats)", "tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(
                f"tool_choice.function.name: {choice.function.name!r} is not one of the tools ({', '.join(names)})",
                "tool_choice",
            )
        forced = self.forced_tools
        if forced is None:
            return
        if self._grammar is not None:
            raise bad_request(
                "tool_choice: a required or named tool call already fixes the output's form; drop "
                'response_format / guided_*, or use tool_choice "auto"',
                "tool_choice",
            )
        self._grammar = _grammar_or_400(
            lambda: self.forced_tool_grammar(None) or "", "tools", "fix the function's parameters schema"
        )

    def forced_tool_grammar(self, tags: tuple[int, int] | None) -> str | None:
        """The grammar of the forced calls (tool_grammar, with the tags' token ids where the vocabulary has them),
        or None when no call is forced."""
        forced = self.forced_tools
        if forced is None:
            return None
        parallel = self.parallel_tool_calls is not False and not isinstance(self.tool_choice, NamedToolChoice)
        specs = [t.model_dump(by_alias=True, exclude_none=True) for t in forced]
        return tool_grammar(specs, parallel, tags)

    @property
    def forced_tools(self) -> list[ToolSpec] | None:
        """The tools the output must call (tool_choice "required": any of them; named: that one), or None."""
        choice = self.tool_choice
        if not self.tools:
            return None
        if choice == "required":
            return list(self.tools)
        if isinstance(choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == choice.function.name]
        return None

    @property
    def parses_tools(self) -> bool:
        """Does the output get read for tool calls (tools given, and tool_choice not "none")?"""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools or ()]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_params(self, max_tokens: int | None = None) -> SamplingParams:
        """The request's params; `max_tokens` fills in when the request has none (chat's default: what is left of
        the context, known only after tokenizing). Without either, 1 stands in so that the rest is validated."""
        fields = self._sampling_fields()
        requested = self.requested_max_tokens
        fields["max_tokens"] = requested if requested is not None else (max_tokens if max_tokens is not None else 1)
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs if self.top_logprobs is not None else 0
        rename = {"logprobs": "top_logprobs", "max_tokens": self.max_tokens_param}
        return make_sampling_params(fields, rename)

    def message_dicts(self, template_takes_tools: bool = True) -> list[dict[str, Any]]:
        """The conversation for the chat template. A template that takes tools gets the calls as structured
        fields (arguments parsed, as transformers passes them); one that does not gets them written into the
        text, and the tools described in the system message (tools_system_prompt)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                if template_takes_tools:
                    d["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.function.name, "arguments": _args(c.function.arguments)},
                        }
                        for c in m.tool_calls
                    ]
                else:
                    calls = "\n".join(render_call(c.function.name, c.function.arguments) for c in m.tool_calls)
                    d["content"] = f"{d['content']}\n{calls}" if d["content"] else calls
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            out.append(d)
        if self.parses_tools and not template_takes_tools:
            prompt = tools_system_prompt(self.tool_dicts())
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def make_sampling_params(fields: Mapping[str, Any], rename: Mapping[str, str] | None = None) -> SamplingParams:
    try:
        return SamplingParams(**fields)
    except ValidationError as exc:
        raise from_validation_error(exc, rename) from None


def parse_json_object(
    raw: BodyBuffer | bytes | bytearray, max_depth: int, max_values: int | None = None
) -> dict[str, Any]:
    """The request body as a JSON object, or an error saying why not: nested deeper than `max_depth` (400) or more
    than `max_values` elements (413), both checked before parsing; not UTF-8, not JSON, not an object, or a string
    that is not whole Unicode characters (400, naming it).

    A BodyBuffer or bytearray is released once decoded, so that a large body is held at most twice at any moment
    (the body and its text, then the text and the strings parsed out of it), never three times."""
    view = raw.view() if isinstance(raw, BodyBuffer) else memoryview(raw)
    try:
        excess = structure_exceeds(view, max_depth, max_values)
        if excess is not None and excess.kind == "depth":
            raise ApiError(
                400,
                f"the request body nests JSON arrays/objects deeper than {max_depth} levels (--max-json-depth), "
                f"at byte {excess.offset:,}",
                code="json_too_deep",
            )
        if excess is not None:
            raise ApiError(
                413,
                f"the request body holds more than {max_values:,} JSON array elements and object members "
                f"(--max-json-values; the first one too many at byte {excess.offset:,})",
                code="too_many_values",
            )
        try:
            # Strict UTF-8 (RFC 8259 section 8.1): surrogates encoded as bytes are refused here, not passed on.
            text = str(view, "utf-8")
        except UnicodeDecodeError as exc:
            raise ApiError(
                400, f"the request body is not valid UTF-8 (byte {exc.start:,}: {exc.reason})", code="invalid_json"
            ) from None
    finally:
        view.release()
        if isinstance(raw, BodyBuffer):
            raw.release()
        elif isinstance(raw, bytearray):
            raw.clear()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    bad = lone_surrogate(text, data)
    if bad is not None:
        where, index, char = bad
        raise ApiError(
            400,
            f"{where}: not valid Unicode: a lone surrogate ({char.encode('unicode_escape').decode()}) at character "
            f"{index:,}; JSON strings must hold whole characters (pair surrogates, or send the character itself)",
            param=where,
            code="invalid_unicode",
        )
    return data


def parse_body(
    model: type[_SamplingFields],
    raw: BodyBuffer | bytes | bytearray,
    max_depth: int,
    max_values: int | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> Any:
    """Parse and shape-check a request body into `model` (nesting deeper than `max_depth`, or more than `max_values`
    JSON values, is refused before the parser sees it), then run its cross-field checks. `defaults`: the served
    model's sampling defaults, used for the sampling fields the body leaves out."""
    try:
        request = model.model_validate(parse_json_object(raw, max_depth, max_values))
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    request.check()  # type: ignore[attr-defined]
    request._defaults = dict(defaults or {})
    return request


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered as /v1/chat/completions renders them.
    `add_special_tokens` defaults to true for a prompt (a BOS where the tokenizer adds one) and false for messages
    (the template writes its own)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: list[ToolSpec] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request(
                "prompt, messages: send exactly one of them (text to tokenize, or chat messages)", "prompt"
            )
        if self.tools and self.messages is None:
            raise bad_request("tools: only with messages (the chat template renders them)", "tools")

    def chat(self) -> ChatCompletionRequest:
        """The messages (and tools) as a chat request, checked as /v1/chat/completions checks them."""
        chat = ChatCompletionRequest(messages=self.messages or [], tools=self.tools)
        chat.check()
        return chat


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's shape): token ids -> their text."""

    model: str | None = None
    tokens: list[int]


def parse_simple(
    model: type[TokenizeRequest] | type[DetokenizeRequest],
    raw: BodyBuffer,
    max_depth: int,
    max_values: int | None = None,
) -> Any:
    """Parse a body into `model` (the limits and 400s of `parse_json_object`, then a 400 naming the first bad
    field), and run its own checks."""
    try:
        request = model.model_validate(parse_json_object(raw, max_depth, max_values))
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    if isinstance(request, TokenizeRequest):
        request.check()
    return request
