"""Run the real service on uvicorn in this process (a thread) or as a subprocess, for the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from glowplug.engine.config import EngineConfig
from glowplug.lifecycle.config import ServeConfig
from glowplug.lifecycle.server import ServiceServer, build_server
from glowplug.profiling.tracing import Tracing

# Only a ceiling: a cold start with torch.compile took 33 s on a loaded 2-core machine.
READY_TIMEOUT_S = 300.0


def engine_config(model: Path, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {"model": str(model), "num_gpu_blocks_override": 512, "seed": 0}
    fields.update(overrides)
    return EngineConfig.from_flat(**fields)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def paced_engine(step_s: float) -> Callable[..., Any]:
    """An engine factory whose every step takes at least `step_s`: a slow device's stand-in, for tests that need a
    request still running a moment later (a queue that stays full, a drain that must cut a stream short) whatever
    this machine's speed. The tiny model decodes its whole 256-position context in a fraction of a second."""

    def build(config: Any, **kwargs: Any) -> Any:
        from glowplug.engine.startup import build_engine

        result = build_engine(config, **kwargs)
        core = result.engine.core
        real_step = core.step

        def step(**kw: Any) -> Any:
            t0 = time.monotonic()
            out = real_step(**kw)
            time.sleep(max(0.0, step_s - (time.monotonic() - t0)))
            return out

        core.step = step
        return result

    return build


class ThreadServer:
    """A ServiceServer on a thread; `stop()` drains it like a signal would and waits for the thread."""

    def __init__(
        self,
        config: EngineConfig,
        serve_cfg: ServeConfig | None = None,
        *,
        tracing: Tracing | None = None,
        engine_factory: Callable[..., Any] | None = None,
    ) -> None:
        self.serve_cfg = serve_cfg or ServeConfig(port=0)
        self.server: ServiceServer = build_server(
            config, self.serve_cfg, tracing=tracing, engine_factory=engine_factory
        )
        self._thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while self.server.bound_port is None:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start listening")
            time.sleep(0.01)
        return self

    @property
    def service(self) -> Any:
        return self.server.service

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.bound_port}"

    def client(self, **kwargs: Any) -> OpenAI:
        # No retries: a 429 or 503 must reach the test, not be retried away by the SDK.
        return OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60.0)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        wait_ready(self.base_url, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.request_shutdown()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("the test server did not stop")


def wait_ready(base_url: str, timeout: float = READY_TIMEOUT_S) -> list[int]:
    """Poll /health/ready until 200; returns every status seen (connection refused counts as 0)."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=5.0) as http:
        while time.monotonic() < deadline:
            try:
                status = http.get("/health/ready").status_code
            except httpx.TransportError:
                status = 0
            seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.05)
    raise AssertionError(f"not ready after {timeout} s; statuses seen: {sorted(set(seen))}")


def metric_samples(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by (sample name, sorted labels); parsed by prometheus_client's parser."""
    text = httpx.get(base_url + "/metrics", timeout=10.0).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(base_url: str, name: str, **labels: str) -> float:
    return metric_samples(base_url).get((name, tuple(sorted(labels.items()))), 0.0)


class ProcessServer:
    """`python -m glowplug.lifecycle` as a real subprocess, output captured to a file."""

    def __init__(
        self, model: Path, log_path: Path, *, env: Mapping[str, str] | None = None, args: list[str] = ()
    ) -> None:  # type: ignore[assignment]
        self.port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "glowplug.lifecycle",
            str(model),
            "--port",
            str(self.port),
            "--num-gpu-blocks-override",
            "512",
            "--log-format",
            "json",
            *args,
        ]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")
