"""run_stages: one span per stage under glowplug.startup, timing, attributes, on_phase, failures."""

from __future__ import annotations

import pytest
from opentelemetry.trace import StatusCode
from startup_fakes import SleepStage, default_pipeline

from glowplug.engine.stages.protocol import Stage, StartupContext, StartupFailed
from glowplug.engine.stages.runner import run_stages
from glowplug.profiling.names import STAGES, STARTUP_SPAN, Attr, stage_span_name
from glowplug.profiling.process import mark_main_entry, open_startup_span
from glowplug.profiling.tracing import Tracing


def _by_name(tracing: Tracing) -> dict[str, object]:
    return {s.name: s for s in tracing.finished_spans()}


def test_span_tree_names_parentage_order_and_attributes(tracing: Tracing) -> None:
    calls: list[tuple[str, str]] = []
    stages = default_pipeline(0.003)
    for s in stages:
        s.events = calls
    ctx = StartupContext(config={"model": "fake"})
    results = run_stages(stages, ctx, tracer=tracing.tracer(), on_phase=lambda n: calls.append(("phase", n)))

    spans = tracing.finished_spans()
    root = next(s for s in spans if s.name == STARTUP_SPAN)
    children = sorted((s for s in spans if s.name != STARTUP_SPAN), key=lambda s: s.start_time)
    assert [c.name for c in children] == [stage_span_name(n) for n in STAGES]
    assert root.parent is None
    assert all(c.parent is not None and c.parent.span_id == root.context.span_id for c in children)
    assert {c.context.trace_id for c in children} == {root.context.trace_id}
    # Sequential and inside the root.
    for a, b in zip(children, children[1:], strict=False):
        assert a.end_time <= b.start_time
    assert root.start_time <= children[0].start_time and children[-1].end_time <= root.end_time
    # on_phase fires right before each stage runs.
    assert calls == [item for n in STAGES for item in (("phase", n), ("run", n))]
    # Report attributes land on the span, lists as tuples.
    named = {c.name: c for c in children}
    assert named["glowplug.startup.load_weights"].attributes[Attr.BYTES_READ] == 1 << 20
    assert named["glowplug.startup.warmup"].attributes[Attr.GRAPH_SIZES] == (1, 2, 4)
    assert named["glowplug.startup.graph_compile"].attributes[Attr.ROW] == "graph_compile_general_shape"
    assert named["glowplug.startup.graph_capture"].attributes[Attr.SKIPPED_REASON] == "skipped: no CUDA"
    assert all(c.attributes[Attr.STAGE] == c.name.rsplit(".", 1)[1] for c in children)
    # Results mirror the spans.
    assert [r.name for r in results] == list(STAGES)
    rows = {r.name: r.row for r in results}
    assert rows["load_weights"] == "load_weights" and rows["graph_capture"] == "graph_capturing"


def test_span_duration_is_the_perf_counter_duration(tracing: Tracing) -> None:
    results = run_stages([SleepStage("load_weights", 0.02)], StartupContext(None), tracer=tracing.tracer())
    span = _by_name(tracing)["glowplug.startup.load_weights"]
    assert span.end_time - span.start_time == round(results[0].seconds * 1e9)  # type: ignore[attr-defined]
    assert 0.02 <= results[0].seconds < 2.0  # at least the sleep; a loaded machine may add any amount


def test_stage_span_is_current_while_the_stage_runs(tracing: Tracing) -> None:
    stage = SleepStage("tokenizer_init", 0.0)
    results = run_stages([stage], StartupContext(None), tracer=tracing.tracer())
    assert stage.seen_span == results[0].span_context


def test_fake_stages_satisfy_the_protocol() -> None:
    assert isinstance(SleepStage("x"), Stage)


def test_failing_stage_gives_error_span_and_one_line_startup_failed(tracing: Tracing) -> None:
    boom = ValueError("weights file truncated\nat offset 1234\nmore detail")
    stages = [SleepStage("tokenizer_init"), SleepStage("load_weights", error=boom), SleepStage("model_init")]
    with pytest.raises(StartupFailed) as info:
        run_stages(stages, StartupContext(None), tracer=tracing.tracer())
    failed = info.value
    assert failed.stage == "load_weights"
    assert failed.cause is boom and failed.__cause__ is boom
    assert failed.reason == "ValueError: weights file truncated"
    assert "\n" not in str(failed) and "load_weights" in str(failed)

    spans = _by_name(tracing)
    bad = spans["glowplug.startup.load_weights"]
    assert bad.status.status_code is StatusCode.ERROR  # type: ignore[attr-defined]
    assert bad.status.description == "ValueError: weights file truncated"  # type: ignore[attr-defined]
    assert bad.attributes[Attr.ERROR] == "ValueError: weights file truncated"  # type: ignore[attr-defined]
    (event,) = bad.events  # type: ignore[attr-defined]
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "ValueError"
    assert "weights file truncated" in event.attributes["exception.message"]
    assert "Traceback" in event.attributes["exception.stacktrace"]
    assert spans["glowplug.startup.tokenizer_init"].status.status_code is StatusCode.UNSET  # type: ignore[attr-defined]
    assert "glowplug.startup.model_init" not in spans  # later stages never ran
    assert spans[STARTUP_SPAN].status.status_code is StatusCode.ERROR  # type: ignore[attr-defined]


def test_stage_returning_no_report_is_a_startup_failure(tracing: Tracing) -> None:
    with pytest.raises(StartupFailed) as info:
        run_stages([SleepStage("warmup", returns=None)], StartupContext(None), tracer=tracing.tracer())
    assert info.value.reason == "TypeError: SleepStage.run returned None, not a StageReport"


def test_keyboard_interrupt_passes_through_but_is_recorded(tracing: Tracing) -> None:
    with pytest.raises(KeyboardInterrupt):
        run_stages([SleepStage("warmup", error=KeyboardInterrupt())], StartupContext(None), tracer=tracing.tracer())
    span = _by_name(tracing)["glowplug.startup.warmup"]
    assert span.status.status_code is StatusCode.ERROR  # type: ignore[attr-defined]


@pytest.mark.parametrize("names", [["a", "a"], ["a.b"], [""]])
def test_bad_stage_names_are_rejected_before_anything_runs(tracing: Tracing, names: list[str]) -> None:
    stages = [SleepStage(n) for n in names]
    with pytest.raises(ValueError):
        run_stages(stages, StartupContext(None), tracer=tracing.tracer())
    assert tracing.finished_spans() == ()


def test_given_parent_is_used_and_left_open(tracing: Tracing) -> None:
    marks = mark_main_entry()
    tracer = tracing.tracer()
    root = open_startup_span(tracer, marks)
    run_stages([SleepStage("tokenizer_init")], StartupContext(None), tracer=tracer, parent=root, clock=marks.clock)
    names = {s.name for s in tracing.finished_spans()}
    assert STARTUP_SPAN not in names  # the caller ends it at READY
    root.end(end_time=marks.clock.now_ns())
    spans = _by_name(tracing)
    root_id = spans[STARTUP_SPAN].context.span_id  # type: ignore[attr-defined]
    for name in ("process_start", "imports", "tokenizer_init"):
        assert spans[f"glowplug.startup.{name}"].parent.span_id == root_id  # type: ignore[attr-defined]
    assert spans[STARTUP_SPAN].start_time == marks.process_start_ns  # type: ignore[attr-defined]
