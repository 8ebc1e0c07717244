"""The server a serving benchmark talks to: one it starts itself (`python -m glowplug.lifecycle` on 127.0.0.1), or
one already running (--base-url); plus reading its /metrics.

A started server is a real process of its own, so its RSS, CPU and GIL are its own, as in production, and it is
stopped with SIGTERM (a drain) when the benchmark ends, even when the benchmark fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from .config import ServeBenchConfig


class ServerError(RuntimeError):
    """The server could not be started or reached; the message says what to check."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_fields(cfg: ServeBenchConfig, **overrides: Any) -> dict[str, Any]:
    """EngineConfig fields (flat names) of the server the benchmark starts, and of its offline twin."""
    fields: dict[str, Any] = {"max_num_seqs": cfg.max_num_seqs, "quantization": cfg.quantization}
    if cfg.max_model_len is not None:
        fields["max_model_len"] = cfg.max_model_len
    fields.update(overrides)
    return cfg.engine_fields(**fields)


def serve_argv(cfg: ServeBenchConfig, port: int, **overrides: Any) -> list[str]:
    """`python -m glowplug.lifecycle ...` for the benchmark's server."""
    from glowplug.profiling.bench.cli_support import engine_flag

    fields = engine_fields(cfg)
    argv = [sys.executable, "-m", "glowplug.lifecycle", str(fields.pop("model"))]
    for name, value in fields.items():
        argv += engine_flag(name, value)
    serve: dict[str, Any] = {"host": "127.0.0.1", "port": port, "max_queue": cfg.max_queue, "log_level": "warning"}
    if cfg.max_queue_wait is not None:
        serve["max_queue_wait"] = cfg.max_queue_wait
    if cfg.served_model_name is not None:
        serve["served_model_name"] = cfg.served_model_name
    serve.update(overrides)
    for name, value in serve.items():
        argv += engine_flag(name, value)
    return argv


def wait_ready(base_url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=5.0, trust_env=False) as http:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise ServerError(f"the server exited with status {proc.returncode} before it was ready")
            try:
                if http.get("/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise ServerError(f"{base_url} was not ready after {timeout:g} s (GET /health/ready)")


class StartedServer:
    """`with StartedServer(cfg) as srv:` a ready server on 127.0.0.1; SIGTERM and wait on exit."""

    def __init__(self, cfg: ServeBenchConfig, *, env: Mapping[str, str] | None = None, **serve_overrides: Any):
        self.port = _free_port()
        self.argv = serve_argv(cfg, self.port, **serve_overrides)
        self._env = {**os.environ, **(env or {})}
        self._log = tempfile.NamedTemporaryFile(prefix="glowplug-bench-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(self._log.name)
        self.proc: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 600.0) -> StartedServer:
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self._env)
        try:
            wait_ready(self.base_url, timeout, self.proc)
        except ServerError as exc:
            self.stop()
            raise ServerError(f"{exc}; its output is in {self.log_path}") from None
        except BaseException:
            self.stop()  # interrupted while waiting (Ctrl-C): `__exit__` will not run, so stop it here
            raise
        return self

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None or self.exit_code is not None:
            return self.exit_code
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.exit_code = self.proc.wait(10)
        self._log.close()
        return self.exit_code

    def __enter__(self) -> StartedServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {sample name{labels}: value} (see `parse_metrics`)."""
    return parse_metrics(httpx.get(base_url + "/metrics", timeout=10.0, trust_env=False).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample name{labels}: value}; label-less samples keep their bare name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def served_model(base_url: str, headers: dict[str, str] | None = None) -> str:
    resp = httpx.get(base_url + "/v1/models", timeout=10.0, trust_env=False, headers=headers)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])
