"""The published OpenAPI document (`GET /openapi.json`), made precise enough for schema-driven clients and fuzzers.

The OpenAI routes read their bodies themselves (so that every 400 names the field the OpenAI way), which leaves
FastAPI's generated document with no request body and a bare 200. Here the document gets, from the same pydantic
models that validate the requests (protocol.py) and from SamplingParams, the one schema of every range:
  - each route's request body, with SamplingParams' ranges merged into the fields that map onto it, the served
    model name as the only `model`, and the limits the server enforces in code (no logit_bias, echo or tools;
    content required on every message but an assistant's);
  - every status a route answers with (400, 404, 408, 413, 429, 431, 500, 503; 401 and a bearer security
    scheme on /v1/* when the server has an API key) and the OpenAI error body they share, with Retry-After on 429;
  - the 200 bodies: JSON, or `text/event-stream` when `stream` is true.
What a JSON schema cannot say (prompt tokens + max_tokens within max-model-len, stream_options only with stream,
top_logprobs only with logprobs, best_of == n, token ids within the vocabulary) stays a documented 400.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from glowplug.engine.sampling_params import SamplingParams

from .protocol import ChatCompletionRequest, CompletionRequest
from .transport import PROTECTED_PATHS, PROTECTED_PREFIX

_REF = "#/components/schemas/{model}"
_RANGE_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


# ---------------------------------------------------------------- response bodies (documentation models)


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    error: ErrorDetail


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprob]
    refusal: None


class CalledFunctionDoc(_Doc):
    name: str
    arguments: str  # JSON text


class ToolCallDoc(_Doc):
    id: str
    type: Literal["function"]
    function: CalledFunctionDoc


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str | None  # null when the reply is tool calls alone
    refusal: None
    tool_calls: list[ToolCallDoc] | None = None


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionResponse(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class SamplingDefaultsDoc(_Doc):
    """The sampling a request gets for the fields it leaves out (engine/generation_config.py)."""

    model_config = ConfigDict(extra="allow")  # the sampling fields the model's generation config sets
    source: str
    temperature: float


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    sampling_defaults: SamplingDefaultsDoc | None = None


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


# ---------------------------------------------------------------- request bodies


def _nullable_branch(prop: dict[str, Any], json_type: str) -> dict[str, Any] | None:
    """The `{"type": json_type}` member of an `X | None` property (or the property itself)."""
    if prop.get("type") == json_type:
        return prop
    for member in prop.get("anyOf", ()):
        if member.get("type") == json_type:
            return member
    return None


def _copy_range(target: dict[str, Any], source: dict[str, Any]) -> None:
    for key in _RANGE_KEYS:
        if key in source:
            target[key] = source[key]


def _sampling_ranges() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, prop in SamplingParams.model_json_schema()["properties"].items():
        out[name] = {}
        for member in (prop, *prop.get("anyOf", ())):  # `int | None` keeps its range on the int member
            out[name].update({k: v for k, v in member.items() if k in _RANGE_KEYS})
    return out


def _refine_sampling(schema: dict[str, Any], ranges: dict[str, dict[str, Any]], model_name: str) -> None:
    props = schema["properties"]
    for name in ("n", "top_k", "seed"):
        if (branch := _nullable_branch(props[name], "integer")) is not None:
            _copy_range(branch, ranges[name])
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        if (branch := _nullable_branch(props[name], "number")) is not None:
            _copy_range(branch, ranges[name])
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props and (branch := _nullable_branch(props[name], "integer")) is not None:
            _copy_range(branch, ranges["max_tokens"])
    props["model"] = {
        "anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
        "default": None,
        "description": "The served model (GET /v1/models); any other name is answered 404 model_not_found.",
    }
    from glowplug.engine.sampling_params import MAX_STOP_STRINGS

    props["stop"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
            {"type": "null"},
        ],
        "default": None,
    }
    props["stop_token_ids"] = {
        "anyOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}}, {"type": "null"}],
        "default": None,
    }
    props["logit_bias"] = {
        "anyOf": [
            {
                "type": "object",
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            },
            {"type": "null"},
        ],
        "default": None,
        "description": "Token id (a decimal string, inside the vocabulary) -> bias added to its logit before "
        "sampling: -100 bans the token, +100 forces it.",
    }


def _refine_completion(schema: dict[str, Any], ranges: dict[str, dict[str, Any]]) -> None:
    props = schema["properties"]
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    props["prompt"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            token_ids,
            {"type": "array", "items": token_ids, "minItems": 1},
        ],
        "description": "Text, texts, token ids, or lists of token ids (one completion group per prompt).",
    }
    lp = _nullable_branch(props["logprobs"], "integer")
    if lp is not None:
        _copy_range(lp, ranges["logprobs"])
    props["echo"] = {
        "anyOf": [{"type": "boolean"}, {"type": "null"}],
        "default": False,
        "description": "Put the prompt's text before each completion's (not with logprobs: 400).",
    }
    props["suffix"] = {
        "anyOf": [{"type": "string"}, {"type": "null"}],
        "default": None,
        "description": "Fill in the middle: the completion goes between the prompt and this text, through the "
        "model's FIM tokens (400 for a model without them).",
    }
    best_of = _nullable_branch(props["best_of"], "integer")
    if best_of is not None:
        _copy_range(best_of, ranges["n"])


def _refine_chat(schema: dict[str, Any], ranges: dict[str, dict[str, Any]], defs: dict[str, Any]) -> None:
    props = schema["properties"]
    top = _nullable_branch(props["top_logprobs"], "integer")
    if top is not None:
        _copy_range(top, ranges["logprobs"])
    # One message shape per role group: content is required except on an assistant turn.
    message = defs["ChatMessage"]
    content = message["properties"]["content"]
    with_content = copy.deepcopy(message)
    with_content["properties"]["role"] = {"type": "string", "enum": ["system", "developer", "user", "tool"]}
    with_content["properties"]["content"] = {"anyOf": [m for m in content["anyOf"] if m.get("type") != "null"]}
    with_content["required"] = ["role", "content"]
    assistant = copy.deepcopy(message)
    assistant["properties"]["role"] = {"type": "string", "enum": ["assistant"]}
    defs["ChatMessage"] = {"title": "ChatMessage", "anyOf": [with_content, assistant]}


def _request_schemas(model_name: str) -> dict[str, Any]:
    _, top = models_json_schema(
        [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")], ref_template=_REF
    )
    defs: dict[str, Any] = top["$defs"]
    ranges = _sampling_ranges()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        _refine_sampling(defs[name], ranges, model_name)
    _refine_completion(defs["CompletionRequest"], ranges)
    _refine_chat(defs["ChatCompletionRequest"], ranges, defs)
    return defs


def _response_schemas() -> dict[str, Any]:
    models = (ErrorResponse, CompletionResponse, ChatCompletionResponse, ModelList)
    _, top = models_json_schema([(m, "serialization") for m in models], ref_template=_REF)
    defs: dict[str, Any] = top["$defs"]
    return defs


# ---------------------------------------------------------------- operations


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _error(description: str, *, retry_after: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": _ref("ErrorResponse")}},
    }
    if retry_after:
        out["headers"] = {
            "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}
        }
    return out


def _generation_operation(request: str, response: str, summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {
                "description": "The completion (JSON), or with `stream: true` server-sent events: one chunk per "
                "step and `data: [DONE]`.",
                "content": {
                    "application/json": {"schema": _ref(response)},
                    # One server-sent event (what an SSE client parses): `data` is a JSON chunk or `[DONE]`.
                    "text/event-stream": {"schema": SSE_EVENT},
                },
            },
            "400": _error(
                "Invalid request: the message names the field, `param` holds its path (also JSON nested "
                "past --max-json-depth, a body that is not UTF-8, a string that is not Unicode)."
            ),
            "404": _error("The model is not served here (`code`: model_not_found)."),
            "408": _error("The body did not arrive within --body-read-timeout (`code`: request_timeout)."),
            "413": _error("The body is larger than --max-body-bytes (`code`: request_too_large)."),
            "431": _error("The request head is larger than 16 KiB (`code`: head_too_large)."),
            "429": _error("Admission control: the queue is full or the expected wait too long.", retry_after=True),
            "500": _error("The engine failed."),
            "503": _error("Not ready yet (Retry-After: start-up ETA), draining, or failed."),
        },
    }


SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "a JSON chunk of the response, or [DONE] after the last one"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def _require_key(doc: dict[str, Any]) -> None:
    """A bearer security scheme on every operation the key protects (transport.py: /v1, /tokenize, /detokenize),
    with its 401."""
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in doc.get("paths", {}).items():
        if path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_PATHS:
            for op in item.values():
                op["security"] = [{"bearer": []}]
                op.setdefault("responses", {})["401"] = _error(
                    "No API key, or not this server's (`code`: invalid_api_key)."
                )


def _refine_document(doc: dict[str, Any], model_name: str, api_key: bool = False) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(_request_schemas(model_name))
    schemas.update(_response_schemas())
    paths = doc.setdefault("paths", {})
    for path, request, response, summary in (
        ("/v1/completions", "CompletionRequest", "CompletionResponse", "Text completion (OpenAI-compatible)."),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse", "Chat completion."),
    ):
        if "post" in paths.get(path, {}):
            paths[path]["post"].update(_generation_operation(request, response, summary))
    if "get" in paths.get("/v1/models", {}):
        paths["/v1/models"]["get"]["responses"] = {
            "200": {"description": "The served model.", "content": {"application/json": {"schema": _ref("ModelList")}}}
        }
    if "get" in paths.get("/health/ready", {}):
        not_ready = {
            "type": "object",
            "properties": {
                "status": {"type": "string"},
                "phase": {"type": ["string", "null"]},
                "reason": {"type": ["string", "null"]},
            },
            "required": ["status"],
        }
        paths["/health/ready"]["get"]["responses"] = {
            "200": {"description": "READY.", "content": {"application/json": {"schema": not_ready}}},
            "503": {
                "description": "Starting, draining, failed or stopped.",
                "content": {"application/json": {"schema": not_ready}},
            },
        }
    if "get" in paths.get("/metrics", {}):
        paths["/metrics"]["get"]["responses"] = {
            "200": {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}
        }
    if api_key:
        _require_key(doc)


def install_openapi(app: FastAPI, model_name: str, *, api_key: bool = False) -> None:
    """Serve the refined document at the app's openapi_url (built once, on first request); `api_key`: the server
    requires one on /v1/*."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _refine_document(doc, model_name, api_key)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
