"""The start-up page and its data routes.

  GET /                    the live start-up / serving page: one self-contained HTML file shipped in the package
                           (lifecycle/static/startup.html: inline CSS, JavaScript and SVG; no CDN, no build step)
  GET /startup/events      server-sent events (see events.py)
  GET /startup/trace.json  the start-up's spans as a Chrome trace (chrome://tracing, ui.perfetto.dev)
  GET /startup/otlp.json   the same spans as OTLP/JSON (one ExportTraceServiceRequest line)
The trace downloads hold the spans of this process's start-up trace that have finished so far: the whole start
once READY (or FAILED), what has run so far while STARTING.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from .errors import ApiError
from .events import StartupEvents

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

    from .progress import Progress
    from .service import Service

PAGE_RESOURCE = "static/startup.html"
_NO_STORE = {"Cache-Control": "no-store"}


@functools.lru_cache(maxsize=1)
def page_html() -> str:
    """The page, read from the installed package (package data, see pyproject.toml)."""
    return resources.files(__package__).joinpath(PAGE_RESOURCE).read_text(encoding="utf-8")


def startup_spans(service: Service) -> list[ReadableSpan]:
    """The finished spans of this service's start-up trace, oldest first."""
    trace_id = service.progress.timeline.trace_id
    if trace_id is None:
        raise ApiError(404, "no start-up trace yet: the start-up has not opened its span", code="no_trace")
    spans = [s for s in service.tracing.finished_spans() if s.context is not None and s.context.trace_id == trace_id]
    if not spans:
        raise ApiError(
            404,
            "no finished start-up spans to export (none has finished yet, or tracing keeps no in-memory copy)",
            code="no_trace",
        )
    return sorted(spans, key=lambda s: s.start_time or 0)


def _download(body: str, name: str, service: Service) -> Response:
    trace_id = service.progress.timeline.snapshot()["trace_id"] or "unknown"
    headers = {**_NO_STORE, "Content-Disposition": f'attachment; filename="glowplug-startup-{trace_id}-{name}"'}
    return Response(body, media_type="application/json", headers=headers)


def add_page_routes(app: FastAPI, service: Service, events: StartupEvents) -> None:
    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html(), headers=_NO_STORE)

    @app.get("/startup/events")
    async def startup_events(request: Request) -> StreamingResponse:
        return StreamingResponse(
            events.stream(request.headers.get("last-event-id")),
            media_type="text/event-stream",
            # no-transform and X-Accel-Buffering keep proxies (nginx) from buffering the stream into uselessness.
            headers={"Cache-Control": "no-store, no-transform", "X-Accel-Buffering": "no"},
        )

    @app.get("/startup/trace.json")
    async def chrome_trace_download() -> Response:
        from glowplug.profiling.export import chrome_trace

        return _download(json.dumps(chrome_trace(startup_spans(service))), "chrome-trace.json", service)

    @app.get("/startup/otlp.json")
    async def otlp_download() -> Response:
        from glowplug.profiling.export import otlp_json_line

        return _download(otlp_json_line(startup_spans(service)) + "\n", "otlp.json", service)


def startup_fields(progress: Progress) -> dict[str, Any]:
    """The span-based part of `/startup`: the timeline, and the display rows of the phase table once there is one."""
    from glowplug.profiling.phases import display_rows

    table = progress.phase_table
    return {
        "timeline": progress.timeline.snapshot(),
        "phase_table_rows": None if table is None else [vars(row) for row in display_rows(table)],
    }
