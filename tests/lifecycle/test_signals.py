"""The service as a real process (`python -m glowplug.lifecycle`): readiness from the first second, SIGTERM
drains (the running stream completes, new requests get 503, traces are flushed, exit 0), a second signal exits."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
from lifecycle_harness import ProcessServer, wait_ready
from otlp_receiver import OtlpHttpReceiver

from glowplug.profiling.names import REQUEST_SPAN, STARTUP_SPAN, ReqAttr

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
# A subprocess server cannot be paced: on the long-context model a stream this long lasts about 8 s here (its
# attention grows with the context), well past the signal; 600 tokens took under a second.
STREAM_TOKENS = 4000


class StreamReader(threading.Thread):
    """Reads one SSE completion stream; `first` is set when the first chunk arrives."""

    def __init__(self, url: str, body: dict, headers: dict[str, str] | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.first = threading.Event()
        self.chunks: list[dict] = []
        self.done_marker = False
        self.error: BaseException | None = None
        self.last_chunk_ns = 0  # wall clock (epoch ns, as OTLP spans carry) of the last JSON chunk

    def run(self) -> None:
        try:
            with httpx.Client(timeout=60.0) as http:
                with http.stream("POST", self.url + "/v1/completions", json=self.body, headers=self.headers) as resp:
                    for line in resp.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            self.done_marker = True
                            continue
                        self.chunks.append(json.loads(line[6:]))
                        self.last_chunk_ns = time.time_ns()
                        self.first.set()
        except BaseException as exc:
            self.error = exc
            self.first.set()

    def tokens(self) -> int:
        return sum(
            len(c["choices"][0]["logprobs"]["tokens"])
            for c in self.chunks
            if c["choices"] and c["choices"][0]["logprobs"]
        )

    def finish_reasons(self) -> list[str]:
        return [
            c["choices"][0]["finish_reason"] for c in self.chunks if c["choices"] and c["choices"][0]["finish_reason"]
        ]


def test_sigterm_drains_then_exits_zero(long_model: Path, tmp_path: Path) -> None:
    with OtlpHttpReceiver() as rx:
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": rx.traces_endpoint}
        srv = ProcessServer(long_model, tmp_path / "server.log", env=env, args=["--drain-timeout", "300"])
        try:
            statuses = wait_ready(srv.base_url, timeout=300)
            # The port opens before the engine is up: readiness answers 503 first, then 200 (never the reverse).
            assert 503 in statuses, statuses
            assert statuses[-1] == 200 and 200 not in statuses[:-1]

            body = {
                "prompt": "The scheduler",
                "max_tokens": STREAM_TOKENS,
                "ignore_eos": True,
                "logprobs": 0,
                "stream": True,
            }
            stream = StreamReader(srv.base_url, body, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
            stream.start()
            assert stream.first.wait(30) and stream.error is None
            srv.signal(signal.SIGTERM)

            with httpx.Client(base_url=srv.base_url, timeout=10.0) as http:
                deadline = time.monotonic() + 10
                status = 0
                while time.monotonic() < deadline:
                    status = http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2}).status_code
                    if status == 503:
                        break
                    time.sleep(0.02)
                assert status == 503
                assert stream.is_alive(), "the stream should still be running while the server drains"
                ready = http.get("/health/ready")
                assert ready.status_code == 503 and ready.json()["status"] == "draining"
                late = http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                assert late.json()["error"]["code"] == "draining"

            stream.join(300)
            assert stream.error is None
            assert stream.finish_reasons() == ["length"]
            assert stream.tokens() == STREAM_TOKENS and stream.done_marker
            assert srv.wait(30) == 0

            spans = rx.wait_for_spans(2, timeout_s=10)
            requests = [s for s in spans if s.name == REQUEST_SPAN and s.trace_id == TRACE_ID]
            assert len(requests) == 1
            req = requests[0]
            assert req.parent_span_id == PARENT_ID
            assert req.attributes[ReqAttr.COMPLETION_TOKENS] == STREAM_TOKENS
            assert req.attributes[ReqAttr.FINISH_REASON] == "length"
            assert any(s.name == STARTUP_SPAN for s in spans)
        finally:
            srv.kill()
    events = [json.loads(line).get("event") for line in srv.output().splitlines() if line.startswith("{")]
    assert "shutdown signal" in events and "drained" in events and "stopped" in events


def test_second_signal_exits_at_once(long_model: Path, tmp_path: Path) -> None:
    srv = ProcessServer(long_model, tmp_path / "server.log", args=["--drain-timeout", "60"])
    try:
        wait_ready(srv.base_url, timeout=300)
        body = {"prompt": "go", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "logprobs": 0, "stream": True}
        stream = StreamReader(srv.base_url, body)
        stream.start()
        assert stream.first.wait(30)
        srv.signal(signal.SIGTERM)
        time.sleep(0.2)
        t0 = time.monotonic()
        srv.signal(signal.SIGINT)
        assert srv.wait(10) == 128 + signal.SIGINT
        assert time.monotonic() - t0 < 5
        stream.join(10)
        assert stream.finish_reasons() == [] and stream.tokens() < STREAM_TOKENS  # cut off, not drained
    finally:
        srv.kill()
