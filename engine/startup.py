"""Build an engine by running the start-up stages; the pipeline is a list, so phases are added, skipped or
reordered by editing `default_stages`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import structlog
import torch

from opentelemetry import trace

from ..profiling.names import SCHEMA_VERSION, STARTUP_SPAN, Attr
from ..profiling.phases import Floor, PhaseTable, build_phase_table
from ..profiling.process import Clock, FullGcDeferral, ProcessMarks, open_startup_span
from ..profiling.tracing import Tracing, setup_tracing
from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import STARTUP_PROFILE
from glowplug.base.artifacts.cachedir import cache_dir_from_env

from .config import EngineConfig
from .config_check import check_device
from .kv_sizing import KVPlan
from .llm_engine import LLMEngine
from .models.arch import ModelArch
from .stages.base import Stage, StageResult, StartupFailed, check_pipeline, run_stages
from .stages.context import EngineContext
from .stages.dynamo_transform import DynamoTransform
from .stages.graph_capture import GraphCapture
from .stages.graph_compile import GraphCompile
from .stages.kv_cache_init import KVCacheInit
from .stages.kv_cache_profiling import KVCacheProfiling
from .stages.load_weights import LoadWeights
from .stages.model_init import ModelInit
from .stages.model_prepare import ModelPrepare
from .stages.native_kernels import NativeKernels
from .stages.quantize_weights import QuantizeWeights
from .stages.tokenizer_init import TokenizerInit
from .stages.warmup import Warmup

__all__ = ["PhaseEstimate", "StartupFailed", "StartupResult", "build_engine", "default_stages",
           "estimate_phase_durations", "expected_phase_durations"]


def default_stages() -> list[Stage]:
    return [
        ModelPrepare(),
        TokenizerInit(),
        LoadWeights(),
        QuantizeWeights(),
        ModelInit(),
        NativeKernels(),
        DynamoTransform(),
        GraphCompile(),
        KVCacheProfiling(),
        KVCacheInit(),
        GraphCapture(),
        Warmup(),
    ]


@dataclass
class StartupResult:
    """What a start leaves once READY: the engine, the record of the start, and a few plain facts about the model.

    The start-up context is not kept: what it held for the stages (the state dict, the trace, the compile cache,
    the scratch state of each stage) is released at READY. The model itself is `engine.model`.
    """

    engine: LLMEngine
    stages: list[StageResult]
    phase_table: PhaseTable
    tracing: Tracing
    kv_plan: KVPlan
    arch: ModelArch
    model_dir: Path
    dtype: torch.dtype


PHASES = "phases.json"


def _profile_factors(config: EngineConfig) -> dict[str, Any]:
    return {"engine_config": config.hash_factors(), "device": config.resolved_device()}


def expected_phase_durations(config: EngineConfig, cache_dir: Path | None = None) -> dict[str, float] | None:
    """Seconds per stage from the last successful start of this config (for an ETA), or None."""

    def load(folder: Path) -> dict[str, float]:
        data = json.loads((folder / PHASES).read_text())
        return {str(k): float(v) for k, v in data["stages"].items()}

    store = ArtifactStore(cache_dir or cache_dir_from_env())
    return store.lookup(STARTUP_PROFILE, _profile_factors(config), group=config.model, load=load).value


@dataclass(frozen=True)
class PhaseEstimate:
    """Seconds per stage to expect, and where they come from: `same_config` when this config started before (its
    last successful start), else the latest start of another config of the same model (a first start of this
    config: its compile and profile caches will miss, so the estimate is a rough one and says so)."""

    seconds: dict[str, float]
    same_config: bool


def estimate_phase_durations(config: EngineConfig, cache_dir: Path | None = None) -> PhaseEstimate | None:
    """The ETA's basis for `config` (see PhaseEstimate), or None when no start of this model was recorded."""
    root = cache_dir or cache_dir_from_env()
    exact = expected_phase_durations(config, root)
    if exact:
        return PhaseEstimate(exact, True)
    store = ArtifactStore(root)
    last = store.latest(STARTUP_PROFILE, config.model)
    if last is None:
        return None
    try:
        data = json.loads((store.entry_path(STARTUP_PROFILE, last.key) / PHASES).read_text())
        return PhaseEstimate({str(k): float(v) for k, v in data["stages"].items()}, False)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # an unreadable old profile only costs the estimate


def _record_phase_durations(ctx: EngineContext, results: list[StageResult]) -> None:
    def build(folder: Path | None) -> None:
        if folder is not None:
            (folder / PHASES).write_text(json.dumps({"stages": {r.name: r.seconds for r in results}}))

    try:
        # refresh: on a read-only cache dir the profile of this config's last start stays, silently (bookkeeping).
        ArtifactStore(ctx.cache_root).put(STARTUP_PROFILE, _profile_factors(ctx.config), group=ctx.config.model,
                                          build=build, refresh=True)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the engine is READY; a lost ETA record must not undo that
        structlog.get_logger("glowplug.startup").warning("start-up profile not recorded", error=repr(exc))


FLOOR_PROBE_BYTES = 256 << 20  # larger than the caches, small enough to add ~0.1 s after READY
FLOOR_PROBE_REPEATS = 3


def measure_floor(weights_bytes: int, import_torch_s: float) -> Floor:
    """The floor of this config: its weights read once at the measured read bandwidth, plus `import torch`."""
    from glowplug.base.machine import measure_probe

    gbps = measure_probe(FLOOR_PROBE_REPEATS, FLOOR_PROBE_BYTES)
    return Floor(weights_bytes=weights_bytes, read_gbps=round(gbps, 3), import_torch_s=import_torch_s)


def build_engine(
    config: EngineConfig,
    *,
    on_phase: Callable[[str], None] | None = None,
    tracing: Tracing | None = None,
    marks: ProcessMarks | None = None,
    stages: Sequence[Stage] | None = None,
    cache_dir: Path | None = None,
) -> StartupResult:
    """Run the start-up pipeline to READY. Raises StartupFailed (stage + one-line cause) when a stage fails.

    marks: the process's entry marks (`mark_main_entry()`); with them the root span starts at process creation and
        the table has the process_start / imports rows. Without them (library use) it starts at this call.
    """
    # Before anything else: `--device cuda` on a torch without CUDA would otherwise end in an AssertionError from
    # deep inside torch, with no flag named and no fix.
    check_device(config)
    pipeline = list(stages) if stages is not None else default_stages()
    check_pipeline(pipeline, EngineContext)  # a bad declaration fails here, before the start-up span opens
    tracing = tracing or setup_tracing(in_memory=True)
    tracer = tracing.tracer()
    ctx = EngineContext(config=config, cache_root=cache_dir or cache_dir_from_env(), device=config.resolved_device())
    clock = marks.clock if marks is not None else Clock()
    # The root span is ours in both modes so that work after READY (the start-up profile, sealing the compile
    # cache) still has a span to report cache events on.
    root = (
        open_startup_span(tracer, marks)
        if marks is not None
        else tracer.start_span(STARTUP_SPAN, start_time=clock.now_ns(), attributes={Attr.SCHEMA_VERSION: SCHEMA_VERSION})
    )
    deferral = FullGcDeferral.start()  # see FullGcDeferral; the process entry may have started one already
    try:
        results = run_stages(
            pipeline,
            ctx,
            tracer=tracer,
            on_phase=on_phase,
            parent=root,
            clock=clock,
        )
    except StartupFailed as failed:
        from opentelemetry.trace import Status, StatusCode

        root.set_status(Status(StatusCode.ERROR, str(failed)))
        root.set_attribute(Attr.ERROR, str(failed))
        root.end(end_time=clock.now_ns())
        raise
    finally:
        deferral.resume()
        if marks is not None and marks.gc_deferral is not None:
            marks.gc_deferral.resume(freeze=ctx.engine is not None)
    ready_ns = clock.now_ns()
    engine = ctx.engine
    assert engine is not None, "the pipeline ended without building an engine (is kv_cache_init in it?)"
    assert ctx.kv_plan is not None and ctx.arch is not None and ctx.model_dir is not None
    with trace.use_span(root, end_on_exit=False):
        _record_phase_durations(ctx, results)
        if ctx.compile_cache is not None:
            ctx.compile_cache.seal()  # graphs compiled after graph_compile (capture) join the verified cache
    root.end(end_time=ready_ns)
    trace_id = results[0].span_context.trace_id if results else None
    # After READY, so it costs the start nothing: the floor needs the import time the CLI measured.
    floor = (measure_floor(ctx.weights_bytes, marks.import_torch_s)
             if marks is not None and marks.import_torch_s is not None else None)  # fmt: skip
    table = build_phase_table(
        [s for s in tracing.finished_spans() if s.name.startswith(STARTUP_SPAN)],
        ready_time_ns=ready_ns,
        trace_id=trace_id,
        floor=floor,
    )
    # The context ends here: the result takes the engine and plain facts, so nothing the stages held (the state
    # dict's extra references, the trace, the compile cache) outlives the start-up through it.
    return StartupResult(engine=engine, stages=results, phase_table=table, tracing=tracing, kv_plan=ctx.kv_plan,
                         arch=ctx.arch, model_dir=ctx.model_dir, dtype=ctx.dtype)  # fmt: skip
