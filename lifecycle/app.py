"""The FastAPI application: health probes, `/startup`, `/metrics`, and the OpenAI routes.

Probes:
  GET /health/live   200 while the process serves HTTP at all (restart me only if this fails).
  GET /health/ready  200 once the warm-up generation succeeded; 503 with the state and every running stage while
                     STARTING (with Retry-After = the start-up ETA, and the ETA itself), DRAINING, FAILED (the
                     reason: a failed start, or an engine core that died) or STOPPED.
  GET /startup       state, every running stage (`running_phases`; `phase` joins them), the phases so far under the
                     phase table's row names (a running one with its elapsed seconds, marked running), the ETA and
                     the predicted time to READY with their basis, per phase too (`eta_phases`: recorded or the
                     start-up model's terms), from the first second, and the full phase table once READY.
  GET /metrics       Prometheus text format, from the service's own registry.
With --api-key, /v1/* needs `Authorization: Bearer <key>`; everything above stays open (transport.py says why).

The live start-up page (`GET /`), its event stream and the trace downloads are in page.py.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from .errors import ApiError
from .events import StartupEvents
from .observe import AccessLogMiddleware
from .openai_api import make_router
from .openapi import install_openapi
from .page import add_page_routes, startup_fields
from .service import Service
from .state import EngineState, StateSnapshot
from .tokenize_api import make_tokenize_router
from .transport import TransportGuard, TransportLimits

log = structlog.get_logger("glowplug.lifecycle.app")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


def startup_report(service: Service, snap: StateSnapshot | None = None) -> dict[str, Any]:
    """The `/startup` body."""
    progress = service.progress
    snap = snap or progress.snapshot()
    running = progress.running_phases(snap)
    report: dict[str, Any] = {
        "state": snap.state.value,
        "phase": ", ".join(running) or None,
        "running_phases": running,
        "phase_elapsed_s": _round(snap.phase_elapsed_s) if snap.phase else None,
        # One clock for the whole start: from process creation (the table's origin); the table's total once READY.
        "elapsed_s": _round(progress.startup_total_s(snap)),
        "phases": progress.phases_so_far(snap),
        "eta_s": _round(progress.eta_s(snap)),
        "eta_basis": progress.eta_basis,
        "predicted_ready_s": _round(progress.predicted_ready_s(snap)),
        "first_predicted_ready_s": _round(progress.first_predicted_ready_s),
        "eta_phases": progress.eta_phases(),
        "expected_phases": progress.expected_phase_seconds,
        "reason": snap.reason,
        "model": service.model_name,
        "config_hash": service.config.compute_hash(),
        "phase_table": None,
        # Under --tensor-parallel-size N: each rank's stage and state (None with one rank).
        "ranks": progress.rank_progress(snap),
    }
    table = progress.phase_table
    if table is not None:
        from glowplug.profiling.phases import to_dict

        report["phase_table"] = to_dict(table)
    report.update(startup_fields(progress))
    return report


def _version() -> str:
    """The installed package's version (its metadata, as `pip show glowplug` reads it)."""
    try:
        return importlib.metadata.version("glowplug")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _readiness(service: Service) -> JSONResponse:
    snap = service.snapshot()
    if snap.state is EngineState.READY:
        return JSONResponse({"status": "ready"})
    running = service.progress.running_phases(snap)
    body: dict[str, Any] = {"status": snap.state.value, "phase": ", ".join(running) or None, "reason": snap.reason}
    headers = {}
    if snap.state is EngineState.STARTING:
        eta = service.progress.eta_s(snap)
        body.update(running_phases=running, eta_s=_round(eta))
        headers["Retry-After"] = str(max(1, math.ceil(eta)) if eta is not None else 1)
    return JSONResponse(body, status_code=503, headers=headers)


def create_app(service: Service, *, tracer: trace.Tracer | None = None) -> FastAPI:
    """The app for `service`; its lifespan starts the service's start-up and closes the service at the end."""

    events = StartupEvents(service)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        service.start()
        events.start()
        try:
            yield
        finally:
            await events.stop()
            await service.close()

    app = FastAPI(title="glowplug", lifespan=lifespan, docs_url=None, redoc_url=None)
    # The last added runs first: the access log wraps the guard, so refusals (401, 413) get their log line too.
    app.add_middleware(TransportGuard, limits=TransportLimits.from_config(service.serve_cfg), metrics=service.metrics)
    app.add_middleware(AccessLogMiddleware)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> Response:
        return ApiError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> Response:
        log.error("unhandled error", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error").response()

    @app.get("/health/live")
    async def live() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/health/ready")
    async def ready() -> Response:
        return _readiness(service)

    @app.get("/health")
    async def health() -> Response:
        """vLLM's and llama.cpp's probe: 200 once READY, 503 (with /health/ready's body) otherwise."""
        return _readiness(service)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/startup")
    async def startup() -> dict[str, Any]:
        return {**startup_report(service), **events.startup_extras()}

    @app.get("/metrics")
    async def metrics() -> Response:
        service.progress.refresh_prediction()
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

    app.include_router(make_router(service, tracer or trace.get_tracer("glowplug")))
    app.include_router(make_tokenize_router(service))
    install_openapi(app, service.model_name, api_key=service.serve_cfg.api_key is not None)
    add_page_routes(app, service, events)
    return app
