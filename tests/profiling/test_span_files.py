"""Span files: OTLP/JSON parses back with protobuf; Chrome trace events nest like the span tree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.trace import format_span_id, format_trace_id
from otlp_receiver import flatten
from startup_fakes import SleepStage, default_pipeline

from glowplug.engine.stages.protocol import StartupContext, StartupFailed
from glowplug.engine.stages.runner import run_stages
from glowplug.profiling.export import chrome_trace, read_otlp_json, write_chrome_trace, write_otlp_json
from glowplug.profiling.names import STARTUP_SPAN, Attr
from glowplug.profiling.tracing import Tracing

HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")


def test_otlp_json_file_parses_back_with_protobuf(tracing: Tracing, tmp_path: Path) -> None:
    run_stages(default_pipeline(0.001), StartupContext(None), tracer=tracing.tracer())
    spans = tracing.finished_spans()
    path = write_otlp_json(spans, tmp_path / "startup.otlp.json")

    lines = path.read_text().splitlines()
    assert len(lines) == 1
    raw = json.loads(lines[0])
    raw_span = raw["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    # OTLP/JSON: lowerCamelCase keys, hex ids, integer enums.
    assert HEX32.match(raw_span["traceId"]) and HEX16.match(raw_span["spanId"])
    assert isinstance(raw_span["kind"], int) and "startTimeUnixNano" in raw_span

    (request,) = read_otlp_json(path)
    assert isinstance(request, ExportTraceServiceRequest)
    received = {s.name: s for s in flatten(request)}
    assert set(received) == {s.name for s in spans}
    for span in spans:
        got = received[span.name]
        assert got.trace_id == format_trace_id(span.context.trace_id)
        assert got.span_id == format_span_id(span.context.span_id)
        assert got.parent_span_id == ("" if span.parent is None else format_span_id(span.parent.span_id))
        assert (got.start_ns, got.end_ns) == (span.start_time, span.end_time)
    assert received["glowplug.startup.warmup"].attributes[Attr.GRAPH_SIZES] == [1, 2, 4]
    assert received["glowplug.startup.graph_compile"].attributes[Attr.CACHE_HIT] is False
    assert received["glowplug.startup.load_weights"].resource["service.name"] == "glowplug-test"
    # The ids are hex (OTLP/JSON), not protobuf's base64 mapping: a naive protobuf parse gets other bytes.
    naive = json_format.Parse(lines[0], ExportTraceServiceRequest())
    assert naive.resource_spans[0].scope_spans[0].spans[0].trace_id.hex() != raw_span["traceId"]


def test_chrome_trace_structure_and_nesting(tracing: Tracing, tmp_path: Path) -> None:
    stages = [SleepStage("tokenizer_init", 0.002), SleepStage("load_weights", 0.004, {Attr.BYTES_READ: 42})]
    stages.append(SleepStage("model_init", 0.001, error=RuntimeError("meta init failed")))
    with pytest.raises(StartupFailed):
        run_stages(stages, StartupContext(None), tracer=tracing.tracer())
    spans = tracing.finished_spans()
    path = write_chrome_trace(spans, tmp_path / "startup.trace.json")
    data = json.loads(path.read_text())

    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(spans)
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
    by_name = {e["name"]: e for e in complete}
    root = by_name[STARTUP_SPAN]
    assert root["ts"] == 0.0  # µs from the earliest span
    for name in ("glowplug.startup.tokenizer_init", "glowplug.startup.load_weights", "glowplug.startup.model_init"):
        e = by_name[name]
        span = next(s for s in spans if s.name == name)
        assert e["dur"] == pytest.approx((span.end_time - span.start_time) / 1e3)
        assert root["ts"] <= e["ts"] and e["ts"] + e["dur"] <= root["ts"] + root["dur"] + 1e-3
        assert e["tid"] == root["tid"] and e["pid"] == root["pid"]  # nested spans share a lane
        assert e["args"]["parent_span_id"] == root["args"]["span_id"]
    assert by_name["glowplug.startup.load_weights"]["dur"] >= 4000
    assert by_name["glowplug.startup.load_weights"]["args"][Attr.BYTES_READ] == 42
    assert by_name["glowplug.startup.model_init"]["args"]["status"] == "ERROR"
    # Parents come before children on equal timestamps.
    assert [e["name"] for e in complete][0] == STARTUP_SPAN
    instants = [e for e in events if e["ph"] == "i"]
    assert [i["name"] for i in instants] == ["exception"]
    assert instants[0]["args"]["exception.type"] == "RuntimeError"
    meta = {(e["name"], e["args"]["name"]) for e in events if e["ph"] == "M"}
    assert ("process_name", "glowplug-test") in meta and ("thread_name", "startup") in meta
    assert data["otherData"]["origin_unix_ns"] == min(s.start_time for s in spans)


def test_overlapping_spans_get_separate_lanes(tracing: Tracing) -> None:
    tracer = tracing.tracer()
    t0 = 1_000_000_000
    a = tracer.start_span("glowplug.request", start_time=t0, context=trace.set_span_in_context(trace.INVALID_SPAN))
    no_parent = trace.set_span_in_context(trace.INVALID_SPAN)
    b = tracer.start_span("glowplug.request", start_time=t0 + 10, context=no_parent)
    child = tracer.start_span("child", start_time=t0 + 20, context=trace.set_span_in_context(a))
    child.end(end_time=t0 + 30)
    a.end(end_time=t0 + 100)
    b.end(end_time=t0 + 200)  # overlaps a without nesting in it
    c = tracer.start_span("glowplug.request", start_time=t0 + 300, context=no_parent)
    c.end(end_time=t0 + 400)
    events = {}
    for e in chrome_trace(tracing.finished_spans())["traceEvents"]:
        if e["ph"] == "X":
            events.setdefault(e["name"], []).append(e)
    (ea, eb, ec) = sorted(events["glowplug.request"], key=lambda e: e["ts"])
    assert ea["tid"] != eb["tid"]
    assert events["child"][0]["tid"] == ea["tid"]
    assert ec["tid"] == ea["tid"]  # after both ended, the first lane is free again
