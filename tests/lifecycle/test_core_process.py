"""The API server and the engine core as two real processes (`glowplug serve`), with the openai client streaming:
the core SIGKILLed mid-stream, SIGTERM to the core with streams in flight, a restarted core and then the server
SIGKILLed. Each checks the exit status, what the client saw and that no process is left. (A tensor-parallel worker
killed while serving: tests/test_tp_processes.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from lifecycle_harness import free_port, wait_ready

FAST = ["--compile", "off", "--num-gpu-blocks-override", "512", "--log-format", "json", "--served-model-name", "tiny"]
# Cut short by the kill: on the long-context model this stream would take about 14 s (900 tokens took under one).
KILLED_STREAM_TOKENS = 6000


class Served:
    """`glowplug serve` as a real process; its engine core is the child running glowplug.engine.core_proc."""

    def __init__(self, model: Path, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.log_path = tmp / f"serve-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "glowplug.cli", "serve", str(model), "--port", str(self.port), *FAST, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.base_url = f"http://127.0.0.1:{self.port}"

    def core(self, timeout: float = 30.0) -> psutil.Process:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in psutil.Process(self.proc.pid).children():
                try:
                    if "glowplug.engine.core_proc" in " ".join(child.cmdline()):
                        return child
                except psutil.NoSuchProcess:
                    continue
            time.sleep(0.05)
        raise AssertionError("the server started no engine core")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


class Stream(threading.Thread):
    """One streamed completion through the openai client: its text, finish reason, or the error it raised."""

    def __init__(self, served: Served, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.served, self.max_tokens = served, max_tokens
        self.first = threading.Event()
        self.tokens = 0
        self.finish: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.served.client().completions.create(
                model="tiny",
                prompt="The scheduler",
                max_tokens=self.max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
                logprobs=0,
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    self.tokens += len(chunk.choices[0].logprobs.tokens or [])
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish = chunk.choices[0].finish_reason
                self.first.set()
        except BaseException as exc:  # noqa: BLE001 - what the client saw is the point
            self.error = exc
        finally:
            self.first.set()


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _ready_status(base_url: str) -> tuple[int, dict[str, Any]]:
    resp = httpx.get(base_url + "/health/ready", timeout=5)
    return resp.status_code, resp.json()


def test_core_killed_mid_stream_ends_streams_with_an_error_and_the_server_exits_1(
    long_model: Path, tmp_path: Path
) -> None:
    srv = Served(long_model, tmp_path, "--failed-exit-delay", "5")
    try:
        wait_ready(srv.base_url, timeout=180)
        core = srv.core()
        stream = Stream(srv, KILLED_STREAM_TOKENS)
        stream.start()
        assert stream.first.wait(60) and stream.error is None
        core.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        status, body = _ready_status(srv.base_url)
        while status == 200 and time.monotonic() - t0 < 10:
            time.sleep(0.02)
            status, body = _ready_status(srv.base_url)
        # Within the 5 s exit delay, so that the server is still there to answer.
        assert status == 503 and time.monotonic() - t0 < 4.0, (status, time.monotonic() - t0)
        assert body["status"] == "failed" and "killed by SIGKILL" in body["reason"], body
        # The open stream ended with an error event: the openai client raises it.
        stream.join(10)
        assert isinstance(stream.error, openai.APIError) and "engine" in str(stream.error), stream.error
        assert stream.finish is None and 0 < stream.tokens < KILLED_STREAM_TOKENS
        # A new request is refused at once, with the reason.
        with pytest.raises(openai.InternalServerError) as info:
            srv.client().completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and "SIGKILL" in info.value.message
        assert srv.proc.wait(30) == 1
        assert _gone([core.pid], 5)
    finally:
        srv.close()


def test_sigterm_to_the_core_drains_both(tiny_model: Path, tmp_path: Path) -> None:
    srv = Served(tiny_model, tmp_path, "--drain-timeout", "120")
    try:
        wait_ready(srv.base_url, timeout=180)
        core = srv.core()
        streams = [Stream(srv, 120) for _ in range(2)]
        for s in streams:
            s.start()
        assert all(s.first.wait(60) for s in streams)
        core.send_signal(signal.SIGTERM)  # not the server: the core asks it to drain
        deadline = time.monotonic() + 10
        status, body = _ready_status(srv.base_url)
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
            status, body = _ready_status(srv.base_url)
        assert (status, body["status"]) == (503, "draining"), body
        for s in streams:
            s.join(120)
            assert s.error is None and s.finish == "length" and s.tokens == 120  # the streams in flight finished
        assert srv.proc.wait(60) == 0
        assert _gone([core.pid], 5)
    finally:
        srv.close()
    stopped = [json.loads(line) for line in srv.output().splitlines() if '"engine core stopped"' in line]
    assert [e["exit_code"] for e in stopped] == [0]


def test_a_restarted_core_serves_again_and_dies_with_its_server(tiny_model: Path, tmp_path: Path) -> None:
    srv = Served(tiny_model, tmp_path, "--restart-core")
    try:
        wait_ready(srv.base_url, timeout=180)
        first = srv.core()
        trace = httpx.get(srv.base_url + "/startup", timeout=5).json()["timeline"]["trace_id"]
        first.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _ready_status(srv.base_url)[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        statuses = wait_ready(srv.base_url, timeout=180)
        assert 503 in statuses
        info = httpx.get(srv.base_url + "/startup", timeout=5).json()
        assert info["state"] == "ready" and info["timeline"]["trace_id"] != trace  # a new start, a new trace
        assert {"core_process_start", "core_imports", "warmup"} <= {p["name"] for p in info["phases"]}
        out = srv.client().completions.create(
            model="tiny", prompt="again", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert out.usage is not None and out.usage.completion_tokens == 4
        second = srv.core()
        assert second.pid != first.pid
        srv.proc.send_signal(signal.SIGKILL)  # the server dies: its core follows, nothing is left
        assert srv.proc.wait(10) == -signal.SIGKILL
        assert _gone([second.pid], 5)
    finally:
        srv.close()
    assert "engine core died; starting a new one" in srv.output()


@pytest.fixture(autouse=True)
def _no_strays() -> Any:
    """Whatever happened, no engine core of these tests outlives them."""
    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    yield
    for p in psutil.Process(os.getpid()).children(recursive=True):
        if p.pid not in before:
            p.kill()
