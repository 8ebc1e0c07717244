"""The soak at CI scale: a real server process (tiny model) under mixed concurrent streams with clients hanging up,
then its own /metrics must show no errors, tokens == usage per stream, the generation counter == the usages plus
the aborted tokens, nothing left running or holding KV blocks, and no RSS growth past the first wave.

The full-scale soak (64 streams, 2 minutes, SmolLM2) is `glowplug bench serve --soak`; this test runs the same code
(`profiling/bench/serve/soak.py`) smaller. It asserts behaviour only, never a speed.
"""

from __future__ import annotations

import signal
from pathlib import Path

from lifecycle_harness import ProcessServer, wait_ready

from glowplug.profiling.bench.serve.soak import KINDS, SoakPlan, run_soak


def test_soak_small_scale(tiny_model: Path, tmp_path: Path) -> None:
    srv = ProcessServer(tiny_model, tmp_path / "server.log", args=["--max-num-seqs", "64"])
    try:
        wait_ready(srv.base_url, timeout=300)
        plan = SoakPlan(
            streams=16, duration_s=12.0, hangup_fraction=0.125, max_tokens=(8, 32), hangup_max_tokens=600, seed=1
        )
        result = run_soak(srv.base_url, plan)
        failed = [c for c in result.checks if not c.passed]
        assert not failed, f"{failed}\nserver log tail:\n{srv.output()[-3000:]}"
        assert result.finished > plan.streams, "expected more than one full wave"
        assert result.hung_up >= 2 and result.aborted_delta > 0
        assert set(KINDS) <= set(result.by_kind)
        srv.signal(signal.SIGTERM)
        assert srv.wait(30) == 0
    finally:
        srv.kill()
