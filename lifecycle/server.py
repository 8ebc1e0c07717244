"""`serve()`: run the service on uvicorn until a signal, then drain and exit.

Two processes: this one (the API server: HTTP, validation, limits, tokenizing, detokenizing, SSE) and the engine
core it starts (engine/core_proc.py), which only steps the engine. This process never imports torch.

Shutdown: the first SIGTERM/SIGINT (to the server, or to the core, which passes it on) moves the engine to DRAINING
(new requests and /health/ready get 503), lets in-flight requests finish for up to `drain_timeout` seconds, aborts
whatever is left, stops the core, stops uvicorn, flushes the trace exporters and returns 0. A second signal exits at
once (status 128 + signal number), killing the core and flushing nothing. A core that dies after READY ends every
open stream with an error event; the server then answers 503 with the reason for `failed_exit_delay` seconds and
returns 1 (or starts a new core, with `restart_core`).

uvicorn's own signal handling is replaced (not wrapped): it would stop serving at the first signal, so a
draining server could not answer 503, and it re-raises the signal after shutdown, which would turn a clean
drain into a "killed by SIGTERM" exit status.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from types import FrameType
from typing import TYPE_CHECKING

import structlog
import uvicorn
from opentelemetry import trace

from glowplug.engine.config import EngineConfig
from glowplug.engine.core_proc import EngineFactory
from glowplug.profiling.logs import configure_logging
from glowplug.profiling.names import DRAIN_SPAN, DrainAttr
from glowplug.profiling.process import ProcessMarks
from glowplug.profiling.tracing import Tracing, setup_tracing

if TYPE_CHECKING:
    from glowplug.profiling.progress import StartupProgress

from .app import create_app
from .config import ServeConfig
from .service import Service
from .transport import guarded_h11

log = structlog.get_logger("glowplug.lifecycle.server")

# After the drain, how long uvicorn waits for connections to close before cancelling what is left.
_GRACEFUL_CLOSE_S = 5.0


class ServiceServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains the service first; `request_shutdown()` is the thread-safe trigger."""

    def __init__(
        self,
        config: uvicorn.Config,
        service: Service,
        drain_timeout: float,
        tracer: trace.Tracer | None = None,
    ) -> None:
        super().__init__(config)
        self.service = service
        self.drain_timeout = drain_timeout
        self.tracer = tracer or trace.get_tracer("glowplug")
        self.bound_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown_requested = False
        self._drain_task: asyncio.Task[None] | None = None
        self.exit_code = 0
        core = service.core
        core.on_fatal = self._core_died
        core.on_notice = lambda notice: self._core_signalled(notice.message)

    def _core_died(self, reason: str) -> None:
        """The core died after READY and is not restarted: answer 503 (with the reason) for a while, then exit 1."""
        self.exit_code = 1
        delay = self.service.serve_cfg.failed_exit_delay
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_later(delay, self.request_shutdown)
        else:
            self.request_shutdown()

    def _core_signalled(self, message: str) -> None:
        log.info("shutdown signal", source=message, drain_timeout_s=self.drain_timeout)
        self.request_shutdown()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        servers = getattr(self, "servers", [])
        if servers and servers[0].sockets:
            self.bound_port = int(servers[0].sockets[0].getsockname()[1])
            display = self.service.progress.display
            if display is not None and display.active:
                display.note(f"listening on http://{self.config.host}:{self.bound_port} (503 until READY)")
            cfg = self.service.serve_cfg
            log.info(
                "listening",
                host=self.config.host,
                port=self.bound_port,
                model=self.service.model_name,
                api_key_required=cfg.api_key is not None,  # whether, never which
                max_body_bytes=cfg.max_body_bytes,
                max_json_depth=cfg.max_json_depth,
                max_json_values=cfg.max_json_values,
                body_read_timeout_s=cfg.body_read_timeout,
                header_read_timeout_s=cfg.header_read_timeout,
            )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes, i.e. possibly inside the event loop: only hand work over.
        if self._shutdown_requested:
            name = signal.Signals(sig).name
            print(f"glowplug: second {name}, exiting now", file=sys.stderr, flush=True)
            self.service.core.kill()
            os._exit(128 + sig)
        log.info("shutdown signal", signal=signal.Signals(sig).name, drain_timeout_s=self.drain_timeout)
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Drain, then stop serving. Safe from any thread; later calls do nothing."""
        if self._shutdown_requested:
            return
        self._shutdown_requested = True
        loop = self._loop
        if loop is None or loop.is_closed():
            self.should_exit = True
            return
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            # The drain span ends before uvicorn stops, so the exit flush (serve()) always carries it.
            with self.tracer.start_as_current_span(DRAIN_SPAN) as span:
                span.set_attribute(DrainAttr.TIMEOUT_S, self.drain_timeout)
                report = await self.service.drain(self.drain_timeout)
                span.set_attribute(DrainAttr.IN_FLIGHT, report.in_flight)
                span.set_attribute(DrainAttr.FINISHED, report.finished)
                span.set_attribute(DrainAttr.ABORTED, report.aborted)
                span.set_attribute(DrainAttr.CLEAN, report.clean)
            log.info(
                "drained",
                clean=report.clean,
                in_flight=report.in_flight,
                finished=report.finished,
                aborted=report.aborted,
            )
        finally:
            self.should_exit = True


def build_server(
    config: EngineConfig,
    serve_cfg: ServeConfig,
    *,
    tracing: Tracing | None = None,
    request_tracing: Tracing | None = None,
    marks: ProcessMarks | None = None,
    engine_factory: EngineFactory | None = None,
    display: StartupProgress | None = None,
    log_json: bool | None = None,
    quiet_stages: bool = False,
) -> ServiceServer:
    """The server, not yet running: `.run()` blocks (signals handled when on the main thread)."""
    service = Service(
        config,
        serve_cfg,
        tracing=tracing,
        marks=marks,
        engine_factory=engine_factory,
        display=display,
        log_json=log_json,
        quiet_stages=quiet_stages,
    )
    spans = request_tracing or tracing
    app = create_app(service, tracer=spans.tracer() if spans is not None else None)
    uv_config = uvicorn.Config(
        app,
        host=serve_cfg.host,
        port=serve_cfg.port,
        log_config=None,  # structlog owns the output; access lines come from our middleware
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=int(_GRACEFUL_CLOSE_S),
        # h11 always (httptools too would need the head timeout of its own): request heads are capped at h11's
        # 16 KiB (a larger one gets 400 from uvicorn) and must arrive within --header-read-timeout.
        http=guarded_h11(serve_cfg.header_read_timeout or None, service.metrics.connections_timed_out.inc),
    )
    return ServiceServer(
        uv_config, service, serve_cfg.drain_timeout, tracer=spans.tracer() if spans is not None else None
    )


def serve(
    config: EngineConfig,
    serve_cfg: ServeConfig,
    *,
    tracing: Tracing | None = None,
    marks: ProcessMarks | None = None,
    engine_factory: EngineFactory | None = None,
    configure_logs: bool = True,
    display: StartupProgress | None = None,
    verbose: bool = False,
) -> int:
    """Serve `config`'s engine over HTTP until SIGTERM/SIGINT; returns the process exit status.

    The port opens at once; the engine starts on a background thread (see /health/ready and /startup).
    tracing: the provider for start-up and request spans; by default one is made here (OTLP export per the
        standard OTEL_* variables) and shut down (flushed) on exit. A caller's own is only flushed.
    marks: `mark_main_entry()` from the CLI's first line, so the phase table includes process start and imports.
    display: the terminal's progress lines (one per stage, as `glowplug startup` prints them); the stages' own
        key=value log records are then left out unless `verbose` (or the logs are JSON).
    """
    json_logs = {"auto": None, "json": True, "console": False}[serve_cfg.log_format]
    quiet_stages = display is not None and not verbose and json_logs is not True
    if configure_logs:
        # While the progress lines show the start-up, the server's own info records wait (the port is a line of
        # the display instead); warnings and errors always show.
        live = display
        quiet = (lambda event: live.active and event.get("level") in ("debug", "info")) if live is not None else None
        configure_logging(level=serve_cfg.log_level, json=json_logs, drop=quiet)
    own = tracing is None
    # Start-up spans are kept in memory for the phase table; request spans are not (they would pile up forever).
    startup_tracing = tracing or setup_tracing("glowplug", in_memory=True)
    request_tracing = tracing or setup_tracing("glowplug", in_memory=False)
    server = build_server(
        config,
        serve_cfg,
        tracing=startup_tracing,
        request_tracing=request_tracing,
        marks=marks,
        engine_factory=engine_factory,
        display=display,
        log_json=json_logs,
        quiet_stages=quiet_stages,
    )
    code = 0
    try:
        server.run()
        code = server.exit_code
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind the port
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        server.service.core.kill()  # a core still running here (a failed bind) must not outlive the server
        _flush(startup_tracing, request_tracing, own)
    log.info("stopped", exit_code=code)
    return code


def _flush(startup: Tracing, requests: Tracing, own: bool) -> None:
    for t in {id(startup): startup, id(requests): requests}.values():
        try:
            if own:
                t.shutdown()
            else:
                t.force_flush(10_000)
        except Exception as exc:
            log.warning("trace flush failed", error=f"{type(exc).__name__}: {exc}")
