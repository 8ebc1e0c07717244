"""The live view while stages overlap (issue 52): /startup and /health/ready name every running stage, the ETA
keeps growing while a stage overruns its estimate (never frozen), and every place gives one time to READY (the log
line, /startup and the table). Two stages that run at once (tokenizer_init beside load_weights) are slowed by the
runner's documented test hook, GLOWPLUG_TEST_STAGE_DELAY."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from lifecycle_harness import ThreadServer, engine_config, metric

from glowplug.engine.stages.runner import STAGE_DELAY_ENV
from glowplug.lifecycle.config import ServeConfig

DELAY_S = 2.0

# The API server's side of a start before it spawns the engine core: the early prediction, in a fresh interpreter.
_EARLY = """
import json, sys
from glowplug.engine.config import EngineConfig
from glowplug.lifecycle.progress import Progress
from glowplug.profiling.tracing import setup_tracing

progress = Progress(setup_tracing("glowplug", in_memory=True))
progress.begin()
progress.predict_early(EngineConfig.model_validate_json(sys.argv[1]))
print(json.dumps({"torch": "torch" in sys.modules, "predicted": progress.predicted_ready_s(),
                  "first": progress.first_predicted_ready_s, "phases": progress.eta_phases(),
                  "basis": progress.eta_basis}))
"""


def test_the_server_predicts_ready_before_the_core_without_torch(tiny_model: Path) -> None:
    config = engine_config(tiny_model, max_num_seqs=3)
    out = subprocess.run(
        [sys.executable, "-c", _EARLY, config.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False, "the API server imported torch to predict the start"
    assert got["predicted"] is not None and got["predicted"] > 0
    assert got["first"] == pytest.approx(got["predicted"], abs=0.5)  # the ETA counts on from the first prediction
    assert got["basis"] and {"load_weights", "kv_cache_init", "warmup"} <= set(got["phases"])
    assert all(v["kind"] in ("recorded", "model") and v["basis"] for v in got["phases"].values())


def test_every_running_stage_is_named_and_the_eta_grows_while_they_overrun(tiny_model: Path, monkeypatch) -> None:
    from glowplug.engine.startup import build_engine

    config = engine_config(tiny_model, max_num_seqs=5)
    build_engine(config)  # a recorded start of this config: the estimate knows these stages take milliseconds
    monkeypatch.setenv(STAGE_DELAY_ENV, f"load_weights={DELAY_S},tokenizer_init={DELAY_S}")
    srv = ThreadServer(config, ServeConfig(port=0)).start()
    polls: list[dict[str, Any]] = []
    try:
        with srv.http() as http:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                info = http.get("/startup").json()
                ready = http.get("/health/ready")
                polls.append({**info, "ready_body": ready.json(), "ready_status": ready.status_code})
                if info["state"] == "ready":
                    break
                time.sleep(0.2)
            final = http.get("/startup").json()
            predicted = metric(srv.base_url, "glowplug_startup_predicted_seconds", prediction="first")
    finally:
        srv.stop()
    both = [p for p in polls if {"load_weights", "tokenizer_init"} <= set(p["running_phases"])]
    assert len(both) >= 3, [p["running_phases"] for p in polls]
    for p in both:
        # Every place names both stages, not the one that happened to start last.
        assert "load_weights" in p["phase"] and "tokenizer_init" in p["phase"]
        if p["ready_status"] == 503:
            assert "load_weights" in p["ready_body"]["phase"] and "tokenizer_init" in p["ready_body"]["phase"]
            assert set(p["ready_body"]["running_phases"]) >= {"load_weights", "tokenizer_init"}
    # Past their estimates, the ETA grows with the time they take instead of standing still.
    late = [p for p in both if p["elapsed_s"] > both[0]["elapsed_s"] + 0.5]
    assert late and late[-1]["eta_s"] > both[0]["eta_s"], [(p["elapsed_s"], p["eta_s"]) for p in both]
    assert all(b["eta_s"] >= a["eta_s"] - 1e-3 for a, b in zip(late, late[1:]))
    # The prediction and its basis were there from the first poll, per phase too.
    assert polls[0]["predicted_ready_s"] is not None and polls[0]["eta_phases"]
    assert all(v["kind"] in ("recorded", "model") and v["basis"] for v in polls[0]["eta_phases"].values())
    # One total: /startup's elapsed time at READY is the table's actual_total_time.
    assert final["state"] == "ready"
    assert final["elapsed_s"] == round(final["phase_table"]["actual_total_time"], 6)
    assert predicted == pytest.approx(final["first_predicted_ready_s"], abs=1e-5)
