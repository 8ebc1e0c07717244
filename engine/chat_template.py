"""Render a model's chat template with jinja2 the way transformers' `apply_chat_template` does, without it.

Same environment (a sandbox, trim_blocks and lstrip_blocks, loop controls), the same helpers templates call
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), and the same variables (messages,
add_generation_prompt, the special tokens by name). Tests compare the rendering with transformers'.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from .models.arch import ModelError


def _raise(message: str) -> None:
    # What a template calls to refuse a conversation (e.g. roles out of order); it reaches the client as a 400.
    raise ModelError(f"the chat template refused the conversation: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters, which would change the prompt; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled template; `render` is cheap after the first compile."""

    def __init__(self, source: str) -> None:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps
            # the body as it is.
            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.Scope(body, lineno=lineno)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelError(f"the model's chat template is not valid jinja ({exc}); fix chat_template") from exc
        self.source = source

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        special_tokens: dict[str, str | None],
        **extra: Any,
    ) -> str:
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens, **extra
        )
