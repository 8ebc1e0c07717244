"""An idle server hands its heap's free pages back once, after IDLE_TRIM_S without a step, and never while it is
stepping. A real server on a tiny model; the trim itself is counted, not timed."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

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
    step_ends: list[float] = []  # when each of the core's steps returned: the idle delay counts from the last

    def engine_factory(config: Any, **kwargs: Any) -> Any:
        result = build_engine(config, **kwargs)
        real_step = result.engine.core.step

        def step(**kw: Any) -> Any:
            out = real_step(**kw)
            step_ends.append(time.monotonic())
            return out

        result.engine.core.step = step
        return result

    # An engine factory runs the core on a thread of this process, where the patches above apply.
    srv = ThreadServer(engine_config(tiny_model), ServeConfig(port=0), engine_factory=engine_factory).start()
    try:
        srv.wait_ready()
        time.sleep(0.6)  # the warm-up steps ran before the loop, so READY alone is no lull
        start = len(trims)
        client = srv.client()
        for i in range(3):  # back to back: no gap of 0.3 s between them
            client.completions.create(model=srv.service.model_name, prompt=f"hello {i}", max_tokens=8)
        deadline = time.monotonic() + 10
        while len(trims) == start and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.8)
        new = trims[start:]
        assert len(new) == 1, f"one trim per lull, got {len(new)}"  # and none since: still idle, no steps
        assert step_ends and new[0] >= step_ends[-1] + 0.3  # only after the idle delay
    finally:
        srv.stop()
