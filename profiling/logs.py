"""structlog set-up: JSON lines for machines, a console renderer for people, trace ids on every line.

Nothing happens at import; call `configure_logging()` once from the entry point. Each line carries the `trace_id`
and `span_id` (hex, as in OTLP/JSON and trace UIs) of the OpenTelemetry span current when it was logged, so a log
line leads to its span and back. The current span comes from OTel's context, which works with any
TracerProvider, global or not.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TextIO

import structlog
from opentelemetry import trace
from opentelemetry.trace import format_span_id, format_trace_id


def add_otel_ids(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: `trace_id` / `span_id` of the current span, when there is a valid one."""
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict.setdefault("trace_id", format_trace_id(ctx.trace_id))
        event_dict.setdefault("span_id", format_span_id(ctx.span_id))
    return event_dict


def _level_number(level: int | str) -> int:
    if isinstance(level, int):
        return level
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning, error or critical")
    return number


def _dropping(drop: Callable[[Mapping[str, Any]], bool]) -> Callable[..., MutableMapping[str, Any]]:
    def processor(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if drop(event_dict):
            raise structlog.DropEvent
        return event_dict

    return processor


def configure_logging(
    *,
    level: int | str = "info",
    json: bool | None = None,
    stream: TextIO | None = None,
    drop: Callable[[Mapping[str, Any]], bool] | None = None,
) -> None:
    """Configure structlog for the process.

    json: None picks JSON lines unless `stream` (default stderr) is a terminal.
    drop: records (with their `level` set) to leave out, e.g. the CLI drops a failed stage's record on a terminal,
        where it says the same thing in one line of its own.
    """
    out = stream if stream is not None else sys.stderr
    if json is None:
        json = not (hasattr(out, "isatty") and out.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        *([_dropping(drop)] if drop is not None else []),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_otel_ids,
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: list[Any]
    if json:
        # dict_tracebacks keeps a traceback inside the one JSON object instead of spilling lines.
        renderer = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=hasattr(out, "isatty") and out.isatty())]
    structlog.configure(
        processors=shared + renderer,
        wrapper_class=structlog.make_filtering_bound_logger(_level_number(level)),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        # Not cached: loggers made before a later reconfiguration (tests, the CLI re-reading flags) follow it.
        cache_logger_on_first_use=False,
    )
