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
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from glowplug.engine.sampling_params import SamplingParams

from .errors import ApiError, bad_request, from_validation_error
from .json_limits import lone_surrogate, structure_exceeds
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
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class StreamOptions(_Body):
    include_usage: bool = False


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
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions, named as in SamplingParams.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
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
        if self.logit_bias:
            raise bad_request("logit_bias: not supported by this server; drop the field", "logit_bias")

    def _sampling_fields(self) -> dict[str, Any]:
        given = {name: getattr(self, name) for name in _PASSTHROUGH if getattr(self, name) is not None}
        return {**self._defaults, **given}


class CompletionRequest(_SamplingFields):
    # Tried in this order, first match wins: in pydantic's default "smart" mode a list of ids was also validated
    # against every other member, and 2^20 of them took 310 ms with the GIL held instead of 27 ms.
    prompt: Union[str, list[int], list[list[int]], list[str]] = Field(union_mode="left_to_right")
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._common_checks()
        if self.echo:
            raise bad_request("echo: not supported by this server; send echo=false", "echo")
        if self.suffix:
            raise bad_request("suffix: not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of: only best_of == n is supported", "best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt: must not be an empty list", "prompt")

    def sampling_params(self) -> SamplingParams:
        fields = self._sampling_fields()
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
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

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
        if self.tools:
            raise bad_request("tools: tool calling is not supported by this server", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request('response_format: only {"type": "text"} is supported', "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")

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

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


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
    model: type[_SamplingFields], raw: BodyBuffer | bytes | bytearray, max_depth: int, max_values: int | None = None,
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
