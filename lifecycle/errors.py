"""OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`, with the offending field named.

Clients (the official SDKs included) read `param` to point at the bad field, so pydantic's error locations are
turned into the field path a user wrote (`messages[0].content`, `max_tokens`), never into schema internals.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

# Tags pydantic adds to a location for the member of a union or a validator, not a field the user wrote.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "tuple"})


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _is_tag(part: str) -> bool:
    return "[" in part or part in _TYPE_TAGS or part[:1].isupper() or part.startswith("function-")


def param_path(loc: Sequence[int | str], rename: Mapping[str, str] | None = None) -> str | None:
    """`("messages", 0, "content", "str")` -> `messages[0].content`; the first field may be renamed."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if i > 0 and _is_tag(part):
            continue
        if i == 0 and rename:
            part = rename.get(part, part)
        out += f".{part}" if out else part
    return out or None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def from_validation_error(exc: ValidationError, rename: Mapping[str, str] | None = None) -> ApiError:
    """A 400 naming the first bad field (pydantic reports a union's failure once per member; one is enough)."""
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    param = param_path(first.get("loc", ()), rename)
    msg = str(first.get("msg", "invalid value"))
    # pydantic prefixes messages of custom validators with "Value error, "; the rest is the engine's own wording.
    msg = msg.removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = f"{param}: this field is required"
    else:
        given = f" (got {_shown(first['input'])})" if "input" in first and not isinstance(first["input"], dict) else ""
        message = f"{param}: {msg}{given}" if param else f"{msg}{given}"
    return ApiError(400, message, param=param, code="invalid_value" if first.get("type") != "missing" else "missing")
