"""An idle server hands its heap's free pages back once, after IDLE_TRIM_S without a step, and never while it is
stepping. A real server on a tiny model; the trim itself is counted, not timed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from lifecycle_harness import ThreadServer, engine_config

import glowplug.engine.core_proc as core_proc
import glowplug.engine.host_memory as host_memory
from glowplug.engine.startup import build_engine
from glowplug.lifecycle.config import ServeConfig


def test_trim_once_per_lull(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[float] = []
    lock = threading.Lock()

    def count() -> bool:
        with lock:
            trims.append(time.monotonic())
        return True

    monkeypatch.setattr(host_memory, "release_free_heap", count)  # the core (a thread here) imports it when due
    monkeypatch.setattr(core_proc, "IDLE_TRIM_S", 0.3)
    # An engine factory runs the core on a thread of this process, where the patches above apply.
    srv = ThreadServer(engine_config(tiny_model), ServeConfig(port=0), engine_factory=build_engine).start()
    try:
        srv.wait_ready()
        time.sleep(0.6)  # the warm-up steps ran before the loop, so READY alone is no lull
        start = len(trims)
        client = srv.client()
        done = time.monotonic()
        for i in range(3):  # back to back: no gap of 0.3 s between them
            client.completions.create(model=srv.service.model_name, prompt=f"hello {i}", max_tokens=8)
            done = time.monotonic()
        time.sleep(1.2)
        new = trims[start:]
        assert len(new) == 1, f"one trim per lull, got {len(new)}"
        assert new[0] >= done + 0.25  # only after the idle delay
        time.sleep(0.8)
        assert len(trims) == start + 1  # still idle, no steps since: no second trim
    finally:
        srv.stop()
