"""structlog lines carry the trace and span ids of the span they were logged under."""

from __future__ import annotations

import io
import json

import structlog
from startup_fakes import SleepStage

from glowplug.engine.stages.protocol import StartupContext
from glowplug.engine.stages.runner import run_stages
from glowplug.profiling.logs import configure_logging
from glowplug.profiling.names import STARTUP_SPAN, Attr
from glowplug.profiling.tracing import Tracing


def test_json_lines_carry_the_ids_of_the_current_span(tracing: Tracing) -> None:
    buf = io.StringIO()
    configure_logging(json=True, stream=buf)
    structlog.get_logger().info("before start-up")
    stages = [
        SleepStage("tokenizer_init", 0.0, log_inside=True),
        SleepStage("load_weights", 0.0, {Attr.BYTES_READ: 7}, log_inside=True),
    ]
    run_stages(stages, StartupContext(None), tracer=tracing.tracer())
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    spans = {s.name: s for s in tracing.finished_spans()}

    assert "trace_id" not in lines[0] and "span_id" not in lines[0]
    inside = [line for line in lines if line["event"] == "inside stage"]
    runner = [line for line in lines if line["event"].startswith(STARTUP_SPAN + ".")]
    assert [line["stage"] for line in inside] == ["tokenizer_init", "load_weights"]
    assert [line["event"] for line in runner] == ["glowplug.startup.tokenizer_init", "glowplug.startup.load_weights"]
    for line in inside + runner:
        span = spans[f"glowplug.startup.{line['stage']}"]
        assert line["trace_id"] == f"{span.context.trace_id:032x}"
        assert line["span_id"] == f"{span.context.span_id:016x}"
        assert line["level"] == "info" and line["timestamp"].endswith("Z")
    # The runner's line uses the span's attribute keys and its measured duration.
    load = runner[1]
    assert load[Attr.BYTES_READ] == 7
    span = spans["glowplug.startup.load_weights"]
    assert round(load["duration_s"] * 1e9) == span.end_time - span.start_time


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_renderer_on_a_terminal_and_level_filter() -> None:
    out = _Tty()
    configure_logging(stream=out, level="warning")
    log = structlog.get_logger()
    log.info("hidden")
    log.warning("shown", stage="load_weights")
    text = out.getvalue()
    assert "hidden" not in text and "shown" in text and "load_weights" in text
    first = text.splitlines()[0]
    try:
        json.loads(first)
    except ValueError:
        pass
    else:
        raise AssertionError("a terminal should get the console renderer, not JSON")


def test_non_tty_defaults_to_json() -> None:
    out = io.StringIO()
    configure_logging(stream=out)
    structlog.get_logger().info("hello", n=1)
    record = json.loads(out.getvalue())
    assert record["event"] == "hello" and record["n"] == 1
