"""Stages that declare needs/provides run at the same time: spans under the start-up span on their own threads,
a phase table that accounts for the overlap against the measured wall time, one trace lane per thread, and the
same failure whichever thread fails first."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from startup_fakes import FakeContext, SleepStage, run_startup

from glowplug.engine.stages.protocol import StageReport, StartupContext, StartupFailed
from glowplug.engine.stages.runner import run_stages
from glowplug.engine.stages.schedule import stage_dependencies
from glowplug.profiling.export import chrome_trace
from glowplug.profiling.names import STARTUP_SPAN, Attr, Row, stage_from_span_name
from glowplug.profiling.tracing import Tracing


@dataclass
class Declared(SleepStage):
    barrier: bool = False


def _pipeline(seconds: float = 0.2) -> list[Declared]:
    # prepare -> {tokenizer, weights -> model} -> engine: the tokenizer overlaps weights + model.
    return [
        Declared("model_prepare", 0.02, needs=(), provides=("model_dir",)),
        Declared("tokenizer_init", seconds, needs=("model_dir",), provides=("tokenizer",)),
        Declared("load_weights", seconds, needs=("model_dir",), provides=("state_dict",)),
        Declared("model_init", seconds, needs=("state_dict",), provides=("model",)),
        Declared("kv_cache_init", 0.02, needs=("model", "tokenizer"), provides=("engine",)),
    ]


def test_dependencies_follow_the_latest_provider_and_barriers() -> None:
    stages = [*_pipeline(), SleepStage("barrier"), Declared("after", needs=("tokenizer",))]
    deps = stage_dependencies(stages)
    assert deps["tokenizer_init"] == ("model_prepare",) and deps["load_weights"] == ("model_prepare",)
    assert deps["model_init"] == ("load_weights",)
    assert set(deps["kv_cache_init"]) == {"model_init", "tokenizer_init"}
    # A barrier waits for everything since the last barrier; everything after waits for it.
    assert set(deps["barrier"]) == set(s.name for s in _pipeline())
    assert deps["after"] == ("barrier",)


def test_independent_stages_overlap_and_spans_nest_under_the_startup_span(tracing: Tracing) -> None:
    table, wall, _ = run_startup(tracing, _pipeline())
    spans = {s.name: s for s in tracing.finished_spans()}
    root = spans[STARTUP_SPAN]
    stages = {stage_from_span_name(n): s for n, s in spans.items() if stage_from_span_name(n)}
    for name in ("model_prepare", "tokenizer_init", "load_weights", "model_init", "kv_cache_init"):
        assert stages[name].parent.span_id == root.context.span_id
        assert stages[name].context.trace_id == root.context.trace_id
    tok, weights, model = stages["tokenizer_init"], stages["load_weights"], stages["model_init"]
    assert tok.start_time < weights.end_time and weights.start_time < tok.end_time  # ran at the same time
    assert tok.attributes[Attr.THREAD_NAME] != weights.attributes[Attr.THREAD_NAME]
    assert model.start_time >= weights.end_time  # it needs the weights
    assert stages["kv_cache_init"].start_time >= max(model.end_time, tok.end_time)
    # Measured outside the runner (the spans' clock is the same perf_counter): the sequential sum would be 0.64 s,
    # the wall time is the critical path. One-sided bounds: a loaded machine only adds time, between the stages too.
    own = sum(
        table.seconds(r) for r in ("model_prepare", "tokenizer_init", "load_weights", "model_init", "kv_cache_init")
    )
    overlap = table.seconds(Row.OVERLAP)
    critical_path = table.seconds(Row.CRITICAL_PATH)
    assert 0.44 <= wall < own - 0.1  # run one after another, the stages would take at least their own times
    # own - overlap is the time the stages covered, inside the wall time; the rest is the gaps between them (1 us:
    # the wall time is float seconds, the spans integer ns).
    gaps = wall - (own - overlap)
    assert -1e-6 <= gaps < 0.1, gaps
    # The tokenizer's time, hidden behind weights + model: never more than the tokenizer's own time.
    assert 0.15 <= overlap <= table.seconds("tokenizer_init")
    assert 0.44 <= critical_path <= wall + 1e-6  # the sleeps along the path, which ran one after another
    assert table[Row.CRITICAL_PATH].reason == "model_prepare -> load_weights -> model_init -> kv_cache_init"
    assert table.actual_total_time <= wall + table.seconds("process_start") + table.seconds("imports") + 0.05
    assert table.seconds(Row.UNATTRIBUTED) >= 0


def test_chrome_trace_has_one_lane_per_thread(tracing: Tracing) -> None:
    run_startup(tracing, _pipeline(0.05))
    trace = chrome_trace(tracing.finished_spans())
    lanes = {e["name"]: e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert lanes["glowplug.startup.tokenizer_init"] != lanes["glowplug.startup.load_weights"]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    root = next(e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] == STARTUP_SPAN)
    assert names[root["tid"]] == "startup"
    threaded = [
        e
        for e in trace["traceEvents"]
        if e.get("ph") == "X"
        and e["name"].startswith(STARTUP_SPAN + ".")
        and e["args"].get(Attr.THREAD_NAME) not in (None, root["args"][Attr.THREAD_NAME])
    ]
    assert threaded
    for event in threaded:
        assert names[event["tid"]] == event["args"][Attr.THREAD_NAME]


class Boom(RuntimeError):
    pass


def test_first_failure_in_pipeline_order_wins_and_running_stages_are_joined(tracing: Tracing) -> None:
    finished: list[str] = []

    @dataclass
    class Recording(Declared):
        def run(self, ctx: StartupContext) -> StageReport:
            report = super().run(ctx)
            finished.append(self.name)
            return report

    stages = [
        Declared("model_prepare", 0.0, needs=(), provides=("model_dir",)),
        # tokenizer fails *later* than weights but comes first in the list: it is the one reported.
        Declared("tokenizer_init", 0.15, needs=("model_dir",), provides=("tokenizer",), error=Boom("tok")),
        Declared("load_weights", 0.02, needs=("model_dir",), provides=("state_dict",), error=Boom("weights")),
        Recording("slow_side", 0.3, needs=("model_dir",), provides=("other",)),
        Declared("model_init", 0.0, needs=("state_dict",), provides=("model",)),
    ]
    before = threading.active_count()
    with pytest.raises(StartupFailed) as err:
        run_stages(stages, FakeContext(), tracer=tracing.tracer())
    assert err.value.stage == "tokenizer_init" and "tok" in err.value.reason
    assert finished == ["slow_side"]  # joined, not abandoned
    assert threading.active_count() == before
    names = {stage_from_span_name(s.name) for s in tracing.finished_spans()}
    assert "model_init" not in names  # nothing starts after a failure


@dataclass
class CpuBound(Declared):
    """A Declared stage that says it keeps every core busy (the compile stages, a measured KV profile)."""

    heavy: bool = True

    def cpu_bound(self, config: object) -> bool:
        return self.heavy


def _heavy_pipeline() -> list[Declared]:
    # model -> {compile, profile}: both CPU-bound and independent of each other, as graph_compile and a measured
    # kv_cache_profiling are.
    return [
        Declared("model_init", 0.01, needs=(), provides=("model",)),
        CpuBound("graph_compile", 0.15, needs=("model",), provides=("engine",)),
        CpuBound("kv_cache_profiling", 0.15, needs=("model",), provides=("other",)),
    ]


@pytest.mark.parametrize("cores", [1, 8])
def test_few_cores_run_cpu_bound_stages_one_after_another_and_say_so(
    tracing: Tracing, monkeypatch: pytest.MonkeyPatch, cores: int
) -> None:
    import glowplug.engine.stages.schedule as base

    monkeypatch.setattr(base, "usable_cores", lambda: cores)
    run_stages(_heavy_pipeline(), FakeContext(), tracer=tracing.tracer())
    spans = {s.name: s for s in tracing.finished_spans()}
    root = spans[STARTUP_SPAN]
    compile_, profile = (spans[f"{STARTUP_SPAN}.{n}"] for n in ("graph_compile", "kv_cache_profiling"))
    assert root.attributes[Attr.USABLE_CORES] == cores
    if cores < base.SERIAL_CPU_BOUND_BELOW_CORES:
        assert root.attributes[Attr.STAGE_CONCURRENCY] == (
            "1 usable core (under 2): CPU-bound stages run one after another (graph_compile -> kv_cache_profiling)"
        )
        assert profile.start_time >= compile_.end_time
        # The extra wait is a dependency like any other (the critical path sees it), and the span says why.
        assert list(profile.attributes[Attr.WAITS_FOR]) == ["model_init", "graph_compile"]
        assert profile.attributes[Attr.SCHEDULING].startswith("runs after graph_compile, not beside it: 1 usable core")
        assert Attr.SCHEDULING not in compile_.attributes
    else:
        assert root.attributes[Attr.STAGE_CONCURRENCY] == "8 usable cores: CPU-bound stages may run side by side"
        assert profile.start_time < compile_.end_time and compile_.start_time < profile.end_time
        assert list(profile.attributes[Attr.WAITS_FOR]) == ["model_init"]
        assert Attr.SCHEDULING not in profile.attributes


def test_one_cpu_bound_stage_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import glowplug.engine.stages.schedule as base

    stages = _heavy_pipeline()
    stages[2].heavy = False  # an analytic KV peak: milliseconds, nothing to keep off the cores
    decision = base.plan_concurrency(stages, None, cores=1)
    assert decision.serial == () and decision.reason == "1 usable core: at most one CPU-bound stage (graph_compile)"
    assert base.stage_dependencies(stages, decision.serial)["kv_cache_profiling"] == ("model_init",)
