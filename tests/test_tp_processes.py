"""Tensor parallelism with real processes: faults (a rank that dies, a rank that never joins, SIGTERM, a worker
crash while serving) and a torchrun launch serving a request through the openai client."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "lifecycle"))
from lifecycle_harness import free_port, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--dtype", "float32", "--quantization", "none", "--num-gpu-blocks-override", "64", "--max-model-len", "256"]


def _env(tmp: Path) -> dict[str, str]:
    # TMPDIR: where rank 0 makes the run folder the ranks write their stage to (the test reads it).
    return {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
        "TMPDIR": str(tmp),
        "OMP_NUM_THREADS": "1",
    }


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "glowplug.cli", *args]


def _progress(tmp: Path) -> dict[int, dict]:
    out = {}
    for f in tmp.glob("glowplug-tp-*/rank-*.json"):
        try:
            entry = json.loads(f.read_text())
        except ValueError:
            continue
        out[entry["rank"]] = entry
    return out


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from glowplug.engine.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp-proc"), "llama", max_position_embeddings=256)


def test_worker_killed_during_load_weights_fails_the_start_naming_it(smollm2_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        _cli(
            "startup",
            "smollm2",
            "--tensor-parallel-size",
            "3",
            "--distributed-timeout",
            "60",
            "--compile",
            "off",
            *FAST,
        ),
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        entry = _progress(tmp_path).get(1)
        if entry is not None and "load_weights" in entry["stage"].split(", "):
            victim = entry["pid"]
            workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.01)
    assert victim is not None, "rank 1 never reached load_weights"
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 60
    text = err.decode()
    # load_weights, and what ran beside it (tokenizer_init) when it did
    assert re.search(
        rf"tensor-parallel rank 1 \(pid {victim}\) was killed by signal 9 in [a-z_, ]*load_weights", text
    ), text[-2000:]
    assert _gone(workers + [proc.pid])


def test_rank_that_never_joins_fails_within_the_timeout(tiny: Path, tmp_path: Path) -> None:
    # Rank 0 as torchrun would start it, with no rank 1 ever started.
    env = {
        **_env(tmp_path),
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    t0 = time.monotonic()
    proc = subprocess.run(
        _cli("startup", str(tiny), "--tensor-parallel-size", "2", "--distributed-timeout", "4", *FAST),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 40
    assert (
        "rank 1 (before its first stage) never joined the tensor-parallel group within --distributed-timeout 4 s"
        in proc.stderr
    ), proc.stderr[-2000:]


def _serve(tiny: Path, tmp: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    log = open(tmp / "serve.log", "wb")  # noqa: SIM115 - the process owns it
    return subprocess.Popen(
        _cli("serve", str(tiny), "--port", str(port), "--tensor-parallel-size", "2", *FAST, *extra),
        env=_env(tmp),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def test_sigterm_drains_and_stops_every_rank(tiny: Path, tmp_path: Path) -> None:
    """Also: while the ranks start, /startup lists each rank's stage (rank 0's being the server's own phases)."""
    port = free_port()
    proc = _serve(tiny, tmp_path, port)
    try:
        seen: list[list[dict]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/startup", timeout=5).json()
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if body.get("ranks") and body.get("state") == "starting":
                seen.append(body["ranks"])
            if body.get("state") != "starting":
                assert "state" in body, body
                break
            time.sleep(0.05)
        assert seen, "/startup never listed the ranks while starting"
        assert [r["rank"] for r in seen[-1]] == [0, 1] and seen[-1][0]["state"] == "starting"
        assert any(r["stage"] for ranks in seen for r in ranks if r["rank"] == 1), seen  # the worker's own stage
        wait_ready(f"http://127.0.0.1:{port}", timeout=120)
        ready = httpx.get(f"http://127.0.0.1:{port}/startup", timeout=5).json()["ranks"]
        assert [r["state"] for r in ready] == ["ready", "ready"], ready
        workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert workers
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": str(tiny), "prompt": "hello", "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 15
        while not _gone(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(workers)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_worker_killed_while_serving_fails_the_core_and_the_server_exits_1(tiny: Path, tmp_path: Path) -> None:
    """Rank 1 killed under a stream: the engine core (rank 0) fails, the stream ends with an error event, readiness
    turns 503 naming the rank, new requests get 503, the server exits 1, and no rank is left."""
    from openai import APIError, OpenAI

    port = free_port()
    proc = _serve(tiny, tmp_path, port, "--failed-exit-delay", "3")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, timeout=120)
        everyone = [c for c in psutil.Process(proc.pid).children(recursive=True)]
        (worker,) = [c for c in everyone if "glowplug.engine.tp_worker" in " ".join(c.cmdline())]
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=str(tiny), prompt="hi", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        worker.kill()
        t0 = time.monotonic()
        with pytest.raises(APIError) as seen:
            for _ in chunks:
                pass
        assert "tensor-parallel rank 1" in str(seen.value), seen.value
        status = httpx.get(base + "/health/ready", timeout=5).status_code
        assert status == 503 and time.monotonic() - t0 < 20
        body = httpx.get(base + "/startup", timeout=5).json()
        assert body["state"] == "failed" and "tensor-parallel rank 1" in json.dumps(body)
        # No request hangs: refused at once.
        r = httpx.post(base + "/v1/completions", timeout=30, json={"model": str(tiny), "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503
        assert proc.wait(60) == 1
        assert _gone([p.pid for p in everyone])
    finally:
        if proc.poll() is None:
            proc.kill()


def test_torchrun_two_ranks_serve_a_request_with_the_openai_client(tiny: Path, tmp_path: Path) -> None:
    from openai import OpenAI

    port = free_port()
    log = open(tmp_path / "torchrun.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "-m",
            "glowplug.cli",
            "serve",
            str(tiny),
            "--port",
            str(port),
            *FAST,
        ],
        env=_env(tmp_path),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout=120)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        out = client.completions.create(model=str(tiny), prompt="hello", max_tokens=8, temperature=0)
        assert out.usage is not None and out.usage.completion_tokens == 8
        startup = httpx.get(f"http://127.0.0.1:{port}/startup", timeout=5).json()
        assert "distributed_init" in json.dumps(startup)
    finally:
        everyone = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    deadline = time.monotonic() + 15
    while not _gone(everyone) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(everyone), (tmp_path / "torchrun.log").read_text()[-3000:]
