"""Start-up as clients see it: readiness, /startup with phases and an ETA, admission before READY, a failed start,
and a drain that runs out of time. The start-up is held at a phase by a gate, so every state is observed."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from lifecycle_harness import ThreadServer, engine_config, metric, paced_engine

from glowplug.lifecycle.config import ServeConfig

# A stage nothing runs beside (it needs both the runner and the compiled step): with stages overlapping, an
# earlier one may run beside another that started later, and the reported phase is the latest started.
HOLD = "graph_capture"


class GatedStart:
    """build_engine, but the start-up stops when phase `hold` begins until `release` is set."""

    def __init__(self, hold: str = HOLD) -> None:
        self.hold = hold
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, config: Any, *, on_phase: Callable[[str], None], tracing: Any = None, marks: Any = None) -> Any:
        from glowplug.engine.startup import build_engine

        def phase(name: str) -> None:
            on_phase(name)
            if name == self.hold:
                self.entered.set()
                self.release.wait(300)

        return build_engine(config, on_phase=phase, tracing=tracing, marks=marks)


def _post_in_thread(url: str, body: dict, results: list) -> threading.Thread:
    def run() -> None:
        with httpx.Client(timeout=60.0) as http:
            results.append(http.post(url + "/v1/completions", json=body))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_ready_503_with_phase_then_200_and_queue_bound(tiny_model: Path) -> None:
    config = engine_config(tiny_model, max_num_seqs=7)
    # A previous start of this config leaves the profile that the ETA comes from.
    from glowplug.engine.startup import build_engine

    build_engine(config)
    gate = GatedStart()
    srv = ThreadServer(config, ServeConfig(port=0, max_queue=2, ready_wait=60), engine_factory=gate).start()
    try:
        assert gate.entered.wait(300)
        with srv.http() as http:
            ready = http.get("/health/ready")
            assert ready.status_code == 503
            body = ready.json()
            assert {k: body[k] for k in ("status", "phase", "reason", "running_phases")} == {
                "status": "starting",
                "phase": HOLD,
                "reason": None,
                "running_phases": [HOLD],
            }
            assert body["eta_s"] is not None and body["eta_s"] > 0
            assert int(ready.headers["retry-after"]) >= 1
            assert http.get("/health/live").status_code == 200
            assert http.get("/health").status_code == 503  # vLLM's probe: 200 only once ready
            info = http.get("/startup").json()
            assert info["state"] == "starting" and info["phase"] == HOLD
            done = {p["name"]: p["seconds"] for p in info["phases"]}
            assert {"imports", "tokenizer_init", "load_weights", "kv_cache_profiling"} <= set(done)
            assert all(s >= 0 for s in done.values())
            assert info["expected_phases"] and "warmup" in info["expected_phases"]
            assert info["eta_s"] is not None and info["eta_s"] >= info["expected_phases"]["warmup"] * 0.99
            # Which recorded start the ETA comes from: this config's, matched on the cache hits and misses.
            assert info["eta_basis"] and "of this config" in info["eta_basis"], info["eta_basis"]

            # Two requests wait for READY and fill the queue; the third is turned away.
            results: list[httpx.Response] = []
            body = {"prompt": "early bird", "max_tokens": 3, "ignore_eos": True}
            waiters = [_post_in_thread(srv.base_url, body, results) for _ in range(2)]
            deadline = time.monotonic() + 10
            while metric(srv.base_url, "glowplug_num_requests_waiting") < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert metric(srv.base_url, "glowplug_num_requests_waiting") == 2
            full = http.post("/v1/completions", json=body)
            assert full.status_code == 429
            assert full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full"
            assert results == []  # still waiting

            gate.release.set()
            for t in waiters:
                t.join(30)
            assert [r.status_code for r in results] == [200, 200]
            assert all(r.json()["usage"]["completion_tokens"] == 3 for r in results)
            assert http.get("/health/ready").status_code == 200
            info = http.get("/startup").json()
            assert info["state"] == "ready" and info["phase"] is None and info["eta_s"] == 0.0
            assert "warmup" in {p["name"] for p in info["phases"]}
            assert info["phase_table"]["phases"]["warmup"] > 0
            assert metric(srv.base_url, "glowplug_request_rejected_total", reason="queue_full") == 1
            assert metric(srv.base_url, "glowplug_num_requests_waiting") == 0
    finally:
        gate.release.set()
        srv.stop()


def test_request_waits_ready_wait_then_503(tiny_model: Path) -> None:
    gate = GatedStart()
    # A ready_wait far above what a request takes on a loaded machine: waited and refused at once differ clearly.
    srv = ThreadServer(engine_config(tiny_model), ServeConfig(port=0, ready_wait=2.0), engine_factory=gate).start()
    try:
        assert gate.entered.wait(300)
        with srv.http() as http:
            t0 = time.monotonic()
            resp = http.post("/v1/completions", json={"prompt": "too early", "max_tokens": 2})
            waited = time.monotonic() - t0
            assert resp.status_code == 503
            assert 2.0 <= waited < 10
            err = resp.json()["error"]
            assert err["code"] == "not_ready" and HOLD in err["message"]
            assert "retry-after" in resp.headers
            # Bad requests are refused at once, before any waiting.
            t0 = time.monotonic()
            assert http.post("/v1/completions", json={"prompt": "x", "top_p": 2}).status_code == 400
            assert time.monotonic() - t0 < 1.0
            gate.release.set()
            srv.wait_ready()
            assert http.post("/v1/completions", json={"prompt": "on time", "max_tokens": 2}).status_code == 200
    finally:
        gate.release.set()
        srv.stop()


def test_failed_start_is_reported(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    srv = ThreadServer(engine_config(missing), ServeConfig(port=0, ready_wait=30)).start()
    try:
        with srv.http() as http:
            deadline = time.monotonic() + 60
            while http.get("/startup").json()["state"] == "starting" and time.monotonic() < deadline:
                time.sleep(0.05)
            info = http.get("/startup").json()
            assert info["state"] == "failed"
            assert info["reason"].startswith("model_prepare")
            assert any(p["failed"] for p in info["phases"])
            ready = http.get("/health/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "failed"
            assert http.get("/health/live").status_code == 200
            t0 = time.monotonic()
            resp = http.post("/v1/completions", json={"prompt": "x"})
            assert resp.status_code == 503 and time.monotonic() - t0 < 5  # no waiting for a start that failed
            assert resp.json()["error"]["code"] == "failed"
            assert metric(srv.base_url, "glowplug_engine_state", glowplug_engine_state="failed") == 1
    finally:
        srv.stop()


def test_drain_timeout_aborts_the_rest(tiny_model: Path) -> None:
    # Paced steps: the stream must outlast the 0.5 s drain however fast this machine decodes (unpaced, the tiny
    # model's 256 positions can all be decoded inside it).
    srv = ThreadServer(
        engine_config(tiny_model), ServeConfig(port=0, drain_timeout=0.5), engine_factory=paced_engine(0.01)
    ).start()
    srv.wait_ready()
    body = {"prompt": "go on", "max_tokens": 1000, "ignore_eos": True, "stream": True, "temperature": 0.0}
    stopper = threading.Thread(target=srv.stop, daemon=True)
    with httpx.Client(base_url=srv.base_url, timeout=60.0) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            t0 = time.monotonic()
            stopper.start()
            rest = [line for line in lines if line.startswith("data:")]
    took = time.monotonic() - t0
    stopper.join(30)
    assert not stopper.is_alive()
    assert srv.service.snapshot().state.value == "stopped"
    chunks = [json.loads(line[5:]) for line in rest if line != "data: [DONE]"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["abort"]
    assert rest[-1] == "data: [DONE]"
    assert 0.4 < took < 10
    tokens = sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"])
    assert tokens < 1000


def test_engine_crash_fails_requests_and_readiness(tiny_model: Path) -> None:
    def crashing(config: Any, **kwargs: Any) -> Any:
        from glowplug.engine.startup import build_engine

        result = build_engine(config, **kwargs)
        core = result.engine.core
        real_step = core.step
        calls = {"n": 0}

        def step(**kw: Any) -> Any:
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("simulated device fault")
            return real_step(**kw)

        core.step = step
        return result

    srv = ThreadServer(engine_config(tiny_model), ServeConfig(port=0), engine_factory=crashing).start()
    try:
        srv.wait_ready()
        with srv.http() as http:
            resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "ignore_eos": True})
            assert resp.status_code == 500
            assert "simulated device fault" in resp.json()["error"]["message"]
            ready = http.get("/health/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "failed"
            assert "simulated device fault" in ready.json()["reason"]
            assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 503
    finally:
        srv.stop()
