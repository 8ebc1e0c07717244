"""`/startup/events` (server-sent events) and the trace downloads against real servers on the tiny model, read by
a plain HTTP client: every phase event in order and equal to the phase table, replay and resumption by
Last-Event-ID, the stream ending at shutdown, a restarted server's fresh log, and the live-metrics arithmetic."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from lifecycle_harness import ThreadServer, engine_config, free_port
from page_support import PacedStartup

from glowplug.engine.startup import default_stages
from glowplug.lifecycle.config import ServeConfig
from glowplug.lifecycle.live_metrics import RecentRequests, ServingSampler, percentile
from glowplug.lifecycle.metrics import ServiceMetrics
from glowplug.lifecycle.page import page_html
from glowplug.profiling.names import CORE_ROWS, STARTUP_SPAN, stage_span_name

PIPELINE = tuple(stage.name for stage in default_stages())
LOGGED = ("phase_start", "phase_end", "state")


def assert_pipeline_order(events: list[tuple[str, str]]) -> None:
    """(phase_start|phase_end, stage) in stream order: every stage once, started after the stages it waits for
    ended (independent stages overlap, so their relative order is free)."""
    from glowplug.engine.stages.schedule import stage_dependencies

    pos = {ev: i for i, ev in enumerate(events)}
    assert len(pos) == len(events) == 2 * len(PIPELINE)
    for stage, deps in stage_dependencies(default_stages()).items():
        assert pos[("phase_start", stage)] < pos[("phase_end", stage)]
        for dep in deps:
            assert pos[("phase_end", dep)] < pos[("phase_start", stage)], (dep, stage)


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """Parse an SSE byte stream's lines into {event, id, data} dicts (comments and retry skipped)."""
    event: dict[str, Any] = {}
    for line in lines:
        if line == "":
            if "data" in event:
                event["data"] = json.loads(event["data"])
                yield event
            event = {}
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field in ("event", "id", "data"):
                event[field] = value


def read_until(
    base_url: str, stop: Any, headers: dict[str, str] | None = None, out: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Events of one connection (appended to `out` as they come) until `stop(event)` or the server ends it."""
    out = [] if out is None else out
    with httpx.Client(timeout=httpx.Timeout(120.0)) as http:
        with http.stream("GET", base_url + "/startup/events", headers=headers or {}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            for event in sse_events(resp.iter_lines()):
                out.append(event)
                if stop(event):
                    break
    return out


def is_ready(event: dict[str, Any]) -> bool:
    return event.get("event") == "state" and event["data"]["state"] == "ready"


def test_every_phase_event_in_order_and_equal_to_the_table(tiny_model: Path) -> None:
    pacing = PacedStartup(hold=("model_prepare",))
    srv = ThreadServer(engine_config(tiny_model), ServeConfig(port=0), engine_factory=pacing).start()
    try:
        pacing.wait_entered("model_prepare")
        events: list[dict[str, Any]] = []

        def collect() -> None:
            # Up to READY, then on to the first metrics tick that comes after it.
            seen_ready = [False]

            def stop(e: dict[str, Any]) -> bool:
                seen_ready[0] = seen_ready[0] or is_ready(e)
                return seen_ready[0] and e["event"] == "metrics" and e["data"]["state"] == "ready"

            events.extend(read_until(srv.base_url, stop))

        reader = threading.Thread(target=collect, daemon=True)
        reader.start()
        pacing.release("model_prepare")
        reader.join(120)
        assert not reader.is_alive()

        hello = events[0]
        assert hello["event"] == "hello" and "id" not in hello
        boot = hello["data"]["boot_id"]
        logged = [e for e in events if e["event"] in LOGGED]
        phases = [(e["event"], e["data"]["stage"]) for e in logged if e["event"] != "state"]
        assert_pipeline_order(phases)
        states = [e["data"]["state"] for e in logged if e["event"] == "state"]
        assert states == ["starting", "ready"] and logged[-1]["event"] == "state"
        ids = [e["id"] for e in logged]
        assert all(i.startswith(boot + ":") for i in ids)
        assert [int(i.split(":")[1]) for i in ids] == list(range(1, len(ids) + 1))
        ticks = [e["data"] for e in events if e["event"] == "metrics"]
        assert ticks and {"running", "waiting", "kv_usage", "tokens_per_s", "ttft", "tpot", "eta_s"} <= set(ticks[-1])

        with httpx.Client(base_url=srv.base_url, timeout=30.0) as http:
            info = http.get("/startup").json()
        table, reasons = info["phase_table"]["phases"], info["phase_table"]["reasons"]
        ends = {e["data"]["stage"]: e["data"] for e in logged if e["event"] == "phase_end"}
        assert sorted(p["stage"] for p in info["timeline"]["phases"]) == sorted(PIPELINE)
        for phase in info["timeline"]["phases"]:
            end = ends[phase["stage"]]
            assert end == phase  # the stream and /startup: one record
            assert end["end_s"] >= end["start_s"] >= 0
            if end["outcome"] == "ran":
                assert table[end["row"]] == end["seconds"]  # exactly the table's number
            else:
                assert end["outcome"] == "skipped" and table[end["row"]] is None
                assert reasons[end["row"]] == end["note"]
        ready = logged[-1]["data"]
        assert ready["trace_id"] == info["phase_table"]["trace_id"]
        shown = {r["name"]: r["seconds"] for r in ready["phase_table_rows"]}
        assert shown == {n: ("--" if s is None else f"{s:.3f}") for n, s in table.items()}
        # /startup's per-phase seconds are the spans' too.
        for entry in info["phases"]:
            if entry["name"] in ends:
                assert entry["seconds"] == round(ends[entry["name"]]["seconds"], 6)

        # A late client gets the same log replayed, with the same ids.
        again = [e for e in read_until(srv.base_url, is_ready) if e["event"] in LOGGED]
        assert again == logged
        # Resuming from an id gets only what came after it; an id of another boot gets everything.
        resumed = read_until(srv.base_url, is_ready, {"Last-Event-ID": logged[4]["id"]})
        assert resumed[0]["data"]["resumed"] is True
        assert [e for e in resumed if e["event"] in LOGGED] == logged[5:]
        other = read_until(srv.base_url, is_ready, {"Last-Event-ID": "0123456789abcdef:3"})
        assert other[0]["data"]["resumed"] is False
        assert [e for e in other if e["event"] in LOGGED] == logged

        # At shutdown the stream says DRAINING and ends by itself (it never holds the shutdown up).
        tail: list[dict[str, Any]] = []
        reader = threading.Thread(target=read_until, args=(srv.base_url, lambda e: False, None, tail), daemon=True)
        reader.start()
        for _ in range(1200):
            if tail or not reader.is_alive():
                break
            reader.join(0.05)
        assert tail and tail[0]["event"] == "hello"
    finally:
        pacing.release_all()
        srv.stop()
    reader.join(30)
    assert not reader.is_alive()
    assert tail[-1]["event"] == "state" and tail[-1]["data"]["state"] == "draining"


def test_a_restarted_server_starts_a_new_log(tiny_model: Path) -> None:
    port = free_port()
    config = engine_config(tiny_model)
    first = ThreadServer(config, ServeConfig(port=port)).start()
    try:
        old = [e for e in read_until(first.base_url, is_ready) if e["event"] in LOGGED]
    finally:
        first.stop()
    second = ThreadServer(config, ServeConfig(port=port)).start()
    try:
        # What a browser does on reconnecting: the same URL, with the last id it saw.
        new = read_until(second.base_url, is_ready, {"Last-Event-ID": old[-1]["id"]})
        hello, logged = new[0], [e for e in new if e["event"] in LOGGED]
        assert hello["data"]["resumed"] is False
        assert hello["data"]["boot_id"] != old[0]["id"].split(":")[0]
        assert logged[0]["id"] == f"{hello['data']['boot_id']}:1" and logged[0]["data"]["state"] == "starting"
        # A core process of its own: its start and its imports are phases too.
        assert sorted(e["data"]["stage"] for e in logged if e["event"] == "phase_end") == sorted(
            [*PIPELINE, *CORE_ROWS]
        )
    finally:
        second.stop()


def test_trace_downloads_hold_the_start(tiny_model: Path) -> None:
    srv = ThreadServer(engine_config(tiny_model), ServeConfig(port=0)).start()
    try:
        srv.wait_ready()
        with httpx.Client(base_url=srv.base_url, timeout=30.0) as http:
            info = http.get("/startup").json()
            trace_hex = info["phase_table"]["trace_id"]
            chrome = http.get("/startup/trace.json")
            otlp = http.get("/startup/otlp.json")
    finally:
        srv.stop()
    for resp in (chrome, otlp):
        assert resp.status_code == 200
        assert resp.headers["content-disposition"].startswith(f'attachment; filename="glowplug-startup-{trace_hex}')
    events = [e for e in chrome.json()["traceEvents"] if e["ph"] == "X"]
    by_name = {e["name"]: e for e in events}
    assert {STARTUP_SPAN, *(stage_span_name(s) for s in PIPELINE)} <= set(by_name)
    assert {e["args"]["trace_id"] for e in events} == {trace_hex}
    for phase in info["timeline"]["phases"]:
        assert abs(by_name[stage_span_name(phase["stage"])]["dur"] - phase["seconds"] * 1e6) < 1e-3
    lines = [json.loads(line) for line in otlp.text.splitlines() if line.strip()]
    spans = [s for line in lines for rs in line["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert {s["traceId"] for s in spans} == {trace_hex}
    assert {STARTUP_SPAN, *(stage_span_name(s) for s in PIPELINE)} <= {s["name"] for s in spans}


# ---------------------------------------------------------------- units


def test_page_is_package_data_and_self_contained() -> None:
    html = page_html()
    assert html.startswith("<!doctype html>") and "/startup/events" in html
    # Nothing is fetched from elsewhere: no external scripts, styles, fonts or images.
    for marker in ("http://", "https://", "//cdn", "<link ", "@import"):
        assert marker not in html.replace("http://www.w3.org/2000/svg", ""), marker


@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=200), st.sampled_from([0, 50, 90, 99, 100]))
def test_percentile_matches_numpy(values: list[float], q: int) -> None:
    assert np.isclose(percentile(sorted(values), q), np.percentile(values, q), rtol=1e-12, atol=1e-12)


def test_recent_window_and_token_rates() -> None:
    now = [100.0]
    recent = RecentRequests(window_s=60.0, clock=lambda: now[0])
    for i in range(10):
        recent.add(ttft_s=0.1 * (i + 1), tpot_s=None if i % 2 else 0.01)
    now[0] += 30
    recent.add(ttft_s=5.0, tpot_s=0.5)
    summary = recent.summary()
    assert summary["ttft"]["n"] == 11 and summary["tpot"]["n"] == 6
    assert np.isclose(summary["ttft"]["p50"], np.percentile([0.1 * (i + 1) for i in range(10)] + [5.0], 50))
    now[0] += 45  # the first ten are now older than the window
    assert recent.summary()["ttft"] == {"p50": 5.0, "p90": 5.0, "p99": 5.0, "n": 1}
    now[0] += 60
    assert recent.summary()["ttft"]["p50"] is None

    metrics = ServiceMetrics()
    clock = [0.0]
    sampler = ServingSampler(metrics.current, metrics.recent, clock=lambda: clock[0])
    assert sampler.sample()["tokens_per_s"] == 0.0
    metrics.generation_tokens.inc(50)
    metrics.prompt_tokens.inc(20)
    metrics.set_engine_gauges(running=3, used_blocks=5, total_blocks=20)
    clock[0] = 2.0
    sample = sampler.sample()
    assert sample["tokens_per_s"] == 25.0 and sample["prompt_tokens_per_s"] == 10.0
    assert (sample["running"], sample["kv_usage"], sample["kv_used_blocks"]) == (3, 0.25, 5)
