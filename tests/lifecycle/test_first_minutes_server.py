"""The server's side of the first five minutes: one default for sampling (the CLI and the HTTP API give the same
text for the same prompt when neither sets a sampling field, and /v1/models says what that default is and where
it comes from), and one name per start-up phase in /metrics and /startup (the phase table's row names; a running
stage shows its elapsed time, marked running)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from lifecycle_harness import ThreadServer, engine_config, metric_samples
from opentelemetry import trace

from glowplug.engine.generation_config import GLOWPLUG_SAMPLING_DEFAULTS, sampling_defaults
from glowplug.lifecycle.config import ServeConfig
from glowplug.lifecycle.progress import Progress
from glowplug.lifecycle.timeline import StartupTimeline
from glowplug.profiling.names import CORE_ROWS, LEAF_ROWS, PRE_MAIN, STAGE_ROWS, STARTUP_SPAN, Row, stage_span_name
from glowplug.profiling.tracing import setup_tracing

PROMPT = "The scheduler mixes prefill chunks"


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ThreadServer]:
    # compile off keeps the one real server lean: the default sampling, not the compiled step, is under test.
    srv = ThreadServer(engine_config(tiny_model, compile="off"), ServeConfig(port=0)).start()
    srv.wait_ready(240)
    yield srv
    srv.stop()


def test_cli_and_server_give_the_same_text_by_default(server: ThreadServer, tiny_model: Path) -> None:
    with server.http() as http:
        body = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}).json()
        card = http.get("/v1/models").json()["data"][0]
    served = body["choices"][0]["text"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "glowplug.cli",
            "generate",
            str(tiny_model),
            PROMPT,
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--compile",
            "off",
            "--num-gpu-blocks-override",
            "512",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    generated = proc.stdout.rsplit("\n(finish_reason=", 1)[0]
    assert generated == PROMPT + served, (generated, served)
    # Both took the same default and said where it came from: /v1/models, and the CLI's start-up lines.
    assert card["sampling_defaults"] == {
        **GLOWPLUG_SAMPLING_DEFAULTS,
        "source": sampling_defaults(str(tiny_model)).source,
    }
    assert "the model has no generation config" in card["sampling_defaults"]["source"]
    assert "glowplug: sampling: temperature 0 (greedy), from glowplug default (greedy)" in proc.stderr


def test_a_generation_config_sets_the_defaults(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9, "bos_token_id": 1})
    )
    got = sampling_defaults(str(folder))
    assert got.values == {"temperature": 0.6, "top_p": 0.9} and got.source.endswith("generation_config.json")
    assert got.describe() == f"temperature 0.6, top p 0.9, from {folder / 'generation_config.json'}"
    # Hugging Face's meaning: do_sample false is greedy whatever the temperature; sampling without one is 1.0.
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert sampling_defaults(str(folder)).values == {"temperature": 0.0}
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_k": 40}))
    assert sampling_defaults(str(folder)).values == {"temperature": 1.0, "top_k": 40}
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 99.0}))
    out_of_range = sampling_defaults(str(folder))
    assert out_of_range.values == GLOWPLUG_SAMPLING_DEFAULTS and "out of range (temperature)" in out_of_range.source


def test_a_gguf_sampling_metadata_sets_the_defaults(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "sampled.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.add_int32("general.sampling.top_k", 30)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = sampling_defaults(str(path))
    assert got.values == {"temperature": 0.25, "top_k": 30} and got.source == f"{path} metadata"
    # The embedded default has no sampling metadata: glowplug's greedy default, saying so.
    assert sampling_defaults("smollm2").values == GLOWPLUG_SAMPLING_DEFAULTS


def test_metrics_and_startup_name_each_phase_once(server: ThreadServer) -> None:
    samples = metric_samples(server.base_url)
    names = {dict(labels)["phase"] for (name, labels) in samples if name == "glowplug_startup_phase_duration_seconds"}
    assert {"tokenizer_init", "load_weights", "warmup", "kv_cache_init"} <= names
    rows = {*LEAF_ROWS, *CORE_ROWS, Row.UNATTRIBUTED}
    assert names <= rows, names - rows
    assert not names & (set(STAGE_ROWS) - set(STAGE_ROWS.values()))  # no stage name beside its row name
    with server.http() as http:
        info = http.get("/startup").json()
    listed = [p["name"] for p in info["phases"]]
    assert len(listed) == len(set(listed)) and set(listed) <= set(info["phase_table"]["phases"])
    # (Without process marks, as here, the table has no imports row; the service times its engine import itself.)
    ran = {p["name"]: p["seconds"] for p in info["phases"] if p["outcome"] == "ran" and p["name"] not in PRE_MAIN}
    for name, seconds in ran.items():  # the table's own numbers, to the microsecond
        assert seconds == pytest.approx(info["phase_table"]["phases"][name], abs=2e-6), name
    skipped = {p["name"] for p in info["phases"] if p["outcome"] == "skipped"}
    assert "graph_capturing" in skipped and info["phase_table"]["phases"]["graph_capturing"] is None  # --compile off


def test_a_running_stage_shows_its_elapsed_time_marked_running(tiny_model: Path) -> None:
    tracing = setup_tracing(in_memory=True)
    progress = Progress(tracing)  # no server: the timeline is fed here
    progress.timeline = StartupTimeline()
    tracing.provider.add_span_processor(progress.timeline)
    tracer = tracing.tracer()
    root = tracer.start_span(STARTUP_SPAN)
    context = trace.set_span_in_context(root)
    tracer.start_span(stage_span_name("kv_cache_init"), context=context).end()
    running = tracer.start_span(stage_span_name("graph_capture"), context=context)
    time.sleep(0.3)
    phases = {p["stage"]: p for p in progress.phases_so_far()}
    assert phases["kv_cache_init"]["running"] is False and phases["kv_cache_init"]["name"] == "kv_cache_init"
    now = phases["graph_capture"]
    assert now["running"] is True and now["outcome"] == "running"
    assert now["name"] == "graph_capturing" and now["seconds"] >= 0.3
    running.end()
    done = {p["stage"]: p for p in progress.phases_so_far()}["graph_capture"]
    assert done["running"] is False and done["seconds"] >= now["seconds"]
    root.end()
    tracing.shutdown()


def test_openapi_documents_the_sampling_defaults(server: ThreadServer) -> None:
    doc = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    card = doc["components"]["schemas"]["ModelCard"]["properties"]
    assert "sampling_defaults" in card
