"""Admission by expected wait: with every engine slot busy, a request whose expected wait (until a running sequence
ends, from what the core reports) exceeds --max-queue-wait is answered 429 queue_wait with Retry-After; with a free
slot, or without the limit, the same request is admitted. A real server (tiny model) and the official client; no
timing is asserted beyond "the long streams are still running when the probe is sent"."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import openai
import pytest
from lifecycle_harness import ThreadServer, engine_config, metric, paced_engine

from glowplug.lifecycle.config import ServeConfig

SLOTS = 2


class Holder(threading.Thread):
    """A long stream that keeps one engine slot busy; `first` is set once it streams."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.first = threading.Event()
        self.finish: str | None = None

    def run(self) -> None:
        body = {"prompt": "hold the slot", "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(base_url=self.base_url, timeout=120) as http:
                with http.stream("POST", "/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            self.first.set()
                            reason = json.loads(line[6:])["choices"][0]["finish_reason"]
                            self.finish = reason or self.finish
        except httpx.HTTPError:
            pass
        finally:
            self.first.set()


def _busy_server(tiny_model: Path, limit: float | None) -> ThreadServer:
    # Paced steps: a 400-token holder lasts at least 4 s, so it is still running when the probe is sent.
    srv = ThreadServer(
        engine_config(tiny_model, max_num_seqs=SLOTS),
        ServeConfig(port=0, max_queue=64, max_queue_wait=limit),
        engine_factory=paced_engine(0.01),
    ).start()
    srv.wait_ready()
    client = srv.client()
    # A few finished requests: the server now knows its decode step time, so the expected wait is known.
    for i in range(6):
        client.completions.create(model=srv.service.model_name, prompt=f"warm {i}", max_tokens=4)
    return srv


def _occupy(srv: ThreadServer) -> list[Holder]:
    """One holder after the other: each finds a free slot and no prompt work ahead, so even a tiny limit admits it
    (two sent at once, the second would wait behind the first's prompt and could be refused)."""
    holders = [Holder(srv.base_url) for _ in range(SLOTS)]
    for h in holders:
        h.start()
        assert h.first.wait(30)
    return holders


def test_free_slot_admits_even_with_zero_limit(tiny_model: Path) -> None:
    srv = _busy_server(tiny_model, limit=0.0)
    try:
        resp = srv.client().completions.create(model=srv.service.model_name, prompt="x", max_tokens=3)
        assert resp.usage.completion_tokens >= 1
    finally:
        srv.stop()


def test_expected_wait_over_the_limit_is_429_with_retry_after(tiny_model: Path) -> None:
    srv = _busy_server(tiny_model, limit=0.001)
    try:
        holders = _occupy(srv)
        assert all(h.is_alive() for h in holders), "the holders finished before the probe; make them longer"
        with pytest.raises(openai.RateLimitError) as info:
            srv.client().completions.create(model=srv.service.model_name, prompt="probe", max_tokens=2)
        err = info.value
        assert err.code == "queue_wait" and err.type == "rate_limit_error"
        assert "max-queue-wait" in err.message
        assert int(err.response.headers["retry-after"]) >= 1
        assert metric(srv.base_url, "glowplug_request_rejected_total", reason="queue_wait") == 1
        for h in holders:
            h.join(60)
            assert h.finish == "length"  # admission control never touches what it admitted
    finally:
        srv.stop()


def test_without_limit_the_request_waits_its_turn(tiny_model: Path) -> None:
    srv = _busy_server(tiny_model, limit=None)
    try:
        holders = _occupy(srv)
        resp = srv.client().completions.create(model=srv.service.model_name, prompt="probe", max_tokens=2)
        assert resp.usage.completion_tokens >= 1
        for h in holders:
            h.join(60)
    finally:
        srv.stop()
