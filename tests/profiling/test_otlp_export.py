"""Real OTLP export: the standard env vars point at in-process HTTP and gRPC receivers; the span tree arrives."""

from __future__ import annotations

import threading

import pytest
from otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver, ReceivedSpan
from startup_fakes import SleepStage, default_pipeline

from glowplug.engine.stages.protocol import StartupContext, StartupFailed
from glowplug.engine.stages.runner import run_stages
from glowplug.profiling.names import STAGES, STARTUP_SPAN, Attr, stage_span_name
from glowplug.profiling.process import mark_main_entry, open_startup_span
from glowplug.profiling.tracing import otlp_target_from_env, setup_tracing


def _run_startup_and_flush() -> list[str]:
    """A full fake start-up exported through whatever the environment configures; returns the span names."""
    tracing = setup_tracing("glowplug-otlp-test")
    assert tracing.otlp is not None
    marks = mark_main_entry()
    tracer = tracing.tracer()
    root = open_startup_span(tracer, marks)
    run_stages(default_pipeline(0.001), StartupContext(None), tracer=tracer, parent=root, clock=marks.clock)
    root.end(end_time=marks.clock.now_ns())
    names = [s.name for s in tracing.finished_spans()]
    tracing.shutdown()  # flushes the batch processor
    return names


def _assert_startup_tree(received: list[ReceivedSpan]) -> None:
    by_name = {s.name: s for s in received}
    expected = {STARTUP_SPAN, *(stage_span_name(n) for n in ("process_start", "imports", *STAGES))}
    assert set(by_name) == expected
    root = by_name[STARTUP_SPAN]
    assert root.parent_span_id == ""
    children = sorted((s for s in received if s.name != STARTUP_SPAN), key=lambda s: s.start_ns)
    assert [c.name.rsplit(".", 1)[1] for c in children] == ["process_start", "imports", *STAGES]
    assert all(c.parent_span_id == root.span_id and c.trace_id == root.trace_id for c in children)
    assert by_name["glowplug.startup.load_weights"].attributes[Attr.BYTES_READ] == 1 << 20
    assert by_name["glowplug.startup.warmup"].attributes[Attr.GRAPH_SIZE_TIMES_S] == [0.01, 0.02, 0.03]
    assert by_name["glowplug.startup.graph_capture"].attributes[Attr.SKIPPED_REASON] == "skipped: no CUDA"
    assert root.resource["service.name"] == "glowplug-otlp-test"


def test_http_receiver_gets_the_span_tree_via_traces_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpHttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.traces_endpoint)
        names = _run_startup_and_flush()
        received = rx.wait_for_spans(len(names))
    _assert_startup_tree(received)
    assert rx.received.metadata[0]["content-type"] == "application/x-protobuf"


def test_http_base_endpoint_gets_the_signal_path_appended(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpHttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        names = _run_startup_and_flush()
        received = rx.wait_for_spans(len(names))
    assert set(rx.paths) == {"/v1/traces"}
    _assert_startup_tree(received)


def test_grpc_receiver_gets_the_span_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpGrpcReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        names = _run_startup_and_flush()
        received = rx.wait_for_spans(len(names))
    _assert_startup_tree(received)


def test_failed_stage_arrives_with_error_status(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpGrpcReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        tracing = setup_tracing()
        with pytest.raises(StartupFailed):
            run_stages(
                [SleepStage("load_weights", error=FileNotFoundError("model.safetensors"))],
                StartupContext(None),
                tracer=tracing.tracer(),
            )
        tracing.shutdown()
        spans = {s.name: s for s in rx.wait_for_spans(2)}
    bad = spans["glowplug.startup.load_weights"]
    assert bad.status_code == 2 and bad.status_message == "FileNotFoundError: model.safetensors"
    assert bad.event_names == ("exception",)
    assert spans[STARTUP_SPAN].status_code == 2


def test_without_endpoint_no_exporter_and_no_thread_is_created() -> None:
    before = set(threading.enumerate())
    tracing = setup_tracing()
    assert tracing.otlp is None
    run_stages([SleepStage("warmup", 0.0)], StartupContext(None), tracer=tracing.tracer())
    assert set(threading.enumerate()) - before == set()
    assert [s.name for s in tracing.finished_spans()][-1] == STARTUP_SPAN
    tracing.shutdown()
    tracing.shutdown()  # idempotent


def test_in_memory_copy_is_optional() -> None:
    tracing = setup_tracing(in_memory=False)
    run_stages([SleepStage("warmup", 0.0)], StartupContext(None), tracer=tracing.tracer())
    assert tracing.memory is None and tracing.finished_spans() == ()
    tracing.shutdown()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ("http/protobuf", "http://c:4318")),
        (
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            },
            ("grpc", "http://t:4317"),
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": " GRPC "},
            ("grpc", "http://c:4317"),
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, None),
    ],
)
def test_target_from_env(env: dict[str, str], expected: tuple[str, str] | None) -> None:
    target = otlp_target_from_env(env)
    assert (None if target is None else (target.protocol, target.endpoint)) == expected


def test_unsupported_protocol_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_PROTOCOL='http/json'.*http/protobuf, grpc"):
        otlp_target_from_env(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
        )


def test_exporter_is_built_off_the_start_up_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing an OTLP exporter is not on the way to READY: it is built on the first export, from the batch
    processor's thread, and every span of the start still reaches the receiver."""
    import glowplug.profiling.tracing as tracing_module

    built_on: list[str] = []
    real = tracing_module._otlp_exporter

    def recording(target: object) -> object:
        built_on.append(threading.current_thread().name)
        return real(target)  # type: ignore[arg-type]

    monkeypatch.setattr(tracing_module, "_otlp_exporter", recording)
    with OtlpHttpReceiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", rx.traces_endpoint)
        names = _run_startup_and_flush()
        received = rx.wait_for_spans(len(names))
    _assert_startup_tree(received)
    assert len(built_on) == 1 and built_on[0] != threading.main_thread().name, built_on
