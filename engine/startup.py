"""Build an engine: plan the start (its cache pattern and ETA), run the start-up stages (engine/start_run.py) and the
hooks at READY (engine/stages/ready.py), return the result. The pipeline is a list, so phases are added, skipped
or reordered by editing `default_stages`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from opentelemetry import trace

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.cachedir import cache_dir_from_env
from glowplug.base.artifacts.store import probes_seen
from glowplug.profiling.names import Attr
from glowplug.profiling.phases import PhaseTable
from glowplug.profiling.process import ProcessMarks
from glowplug.profiling.tracing import Tracing, setup_tracing

from .config import EngineConfig
from .config_check import check_device
from .distributed import TPGroup
from .kv_sizing import KVPlan
from .llm_engine import LLMEngine
from .models.arch import ModelArch
from .models.store import model_group
from .stages.context import EngineContext
from .stages.distributed_init import DistributedInit
from .stages.dynamo_transform import DynamoTransform
from .stages.grammar_init import GrammarInit
from .stages.graph_capture import GraphCapture
from .stages.graph_compile import GraphCompile
from .stages.kv_cache_init import KVCacheInit
from .stages.kv_cache_profiling import KVCacheProfiling
from .stages.load_weights import LoadWeights
from .stages.model_init import ModelInit
from .stages.model_prepare import ModelPrepare
from .stages.native_kernels import NativeKernels
from .stages.protocol import Stage, StageResult, StartupFailed, check_pipeline
from .stages.quantize_weights import QuantizeWeights
from .stages.ready import ready_hooks
from .stages.schedule import plan_concurrency, stage_dependencies
from .stages.tokenizer_init import TokenizerInit
from .stages.warmup import Warmup
from .start_estimate import MISS, UNKNOWN, PhaseEstimate, pattern_text, stage_caches
from .start_inputs import StartInputs, gather_inputs
from .start_profile import (
    StartPlan,
    estimate_for,
    latest_probe,
    lookup_records,
    machine_records,
    profile_entries,
    this_machine,
    with_page_cache,
)
from .start_run import StartRun

__all__ = [
    "PhaseEstimate",
    "StartPlan",
    "StartupFailed",
    "StartupResult",
    "build_engine",
    "default_stages",
    "estimate_phase_durations",
    "expected_phase_durations",
    "plan_start",
    "probe_cache_pattern",
]


def default_stages(config: EngineConfig | None = None) -> list[Stage]:
    """The pipeline; with `config` asking for tensor parallelism, distributed_init first (it needs nothing, so it
    runs beside model_prepare; kv_cache_init waits for it)."""
    parallel: list[Stage] = [DistributedInit()] if config is not None and config.tensor_parallel_size > 1 else []
    return parallel + [
        ModelPrepare(),
        TokenizerInit(),
        GrammarInit(),
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
    plan: StartPlan | None = None  # the cache pattern and the ETA made before the first stage
    # Under tensor parallelism: this rank's handle on the group (engine/distributed.py). Rank 0's engine already
    # broadcasts its steps through it; a worker runs `serve_worker`. `close()` stops every rank.
    parallel: TPGroup | None = None


def expected_phase_durations(config: EngineConfig, cache_dir: Path | None = None) -> dict[str, float] | None:
    """Seconds per stage from the last successful start of this config, whatever its caches did, or None. The ETA
    uses `plan_start`, which picks the start with the same cache hits."""
    records = lookup_records(ArtifactStore(cache_dir or cache_dir_from_env()), config)
    return dict(records[0].stages) if records else None


def probe_cache_pattern(
    config: EngineConfig, cache_dir: Path | None = None, stages: Sequence[Stage] | None = None
) -> dict[str, str]:
    """Which cache entries a start of `config` will hit, asked of each stage that owns a cache's factors
    (`cache_probe`), in pipeline order, on a scratch context: nothing is loaded, built or moved. A probe that
    cannot tell (say the model folder is not prepared yet, so later factors are unknown) leaves its caches
    `unknown`, or `miss` when the cache holds no entry of this model at all."""
    from glowplug.base.artifacts.caches import by_name

    root = cache_dir or cache_dir_from_env()
    ctx = EngineContext(config=config, cache_root=root, device=config.resolved_device())
    store = ArtifactStore(root)
    pattern: dict[str, str] = {}
    for stage in stages if stages is not None else default_stages(config):
        probe = getattr(stage, "cache_probe", None)
        if probe is None:
            continue
        try:
            pattern.update(probe(ctx))
        except Exception:  # noqa: BLE001 - a prediction: what it cannot tell is unknown, the start is unaffected
            for cache in getattr(stage, "caches", ()):
                if cache in pattern:
                    continue
                try:
                    empty = store.latest(by_name(cache), model_group(config.model)) is None
                except (OSError, ValueError):
                    empty = False
                pattern[cache] = MISS if empty else UNKNOWN
    return pattern


def pipeline_waits(config: EngineConfig, stages: Sequence[Stage]) -> dict[str, tuple[str, ...]]:
    """stage -> the stages it will wait for, as the runner will schedule them on this machine."""
    return stage_dependencies(stages, plan_concurrency(stages, config).serial)


def plan_start(config: EngineConfig, cache_dir: Path | None = None, stages: Sequence[Stage] | None = None) -> StartPlan:
    """The pattern of this start, its inputs and its estimate (engine/start_estimate.py `predict` says which record
    or model term serves which phase). Never raises for an unreadable cache dir: that costs the estimate only."""
    root = cache_dir or cache_dir_from_env()
    pipeline = list(stages) if stages is not None else default_stages(config)
    log = structlog.get_logger("glowplug.startup")
    notes: list[str] = []
    with probes_seen() as seen:
        try:
            pattern = probe_cache_pattern(config, root, pipeline)
        except Exception as exc:  # noqa: BLE001 - the ETA must never stop a start
            log.info("cache pattern unknown", error=repr(exc))
            notes.append(f"cache pattern unknown ({exc!r})")
            pattern = {}
    store = ArtifactStore(root)
    keys = {cache: path.name for cache, path, _ in seen}
    hits = {cache: path for cache, path, hit in seen if hit}
    try:
        entries = profile_entries(store)
    except Exception:  # noqa: BLE001 - an unreadable cache dir costs the estimate only; the start says the rest
        entries = []
    try:
        inputs: StartInputs | None = gather_inputs(
            config, entries=hits, probe_gbps=latest_probe(machine_records(entries))
        )
        notes += inputs.notes if inputs is not None else []
    except Exception as exc:  # noqa: BLE001 - without inputs the model is left out; the records still serve
        log.info("start-up inputs unknown", error=repr(exc))
        notes.append(f"start-up inputs unknown ({exc})")
        inputs = None
    pattern = with_page_cache(pattern, inputs)
    deps = pipeline_waits(config, pipeline)
    try:
        estimate = estimate_for(
            config, store, config.resolved_device(), pattern, stage_caches(pipeline), deps, inputs, entries
        )
    except Exception as exc:  # noqa: BLE001 - an unreadable profile costs the estimate only
        log.info("no start-up estimate", error=repr(exc))
        estimate = None
    return StartPlan(pattern, estimate, inputs, deps, keys, this_machine(), tuple(notes))


def estimate_phase_durations(config: EngineConfig, cache_dir: Path | None = None) -> PhaseEstimate | None:
    """The ETA's basis for `config` (see PhaseEstimate), or None when no start of this model was recorded."""
    return plan_start(config, cache_dir).estimate


def _eta_attributes(plan: StartPlan, marks: ProcessMarks | None, begun_ns: int) -> dict[str, Any]:
    """The pattern and the first ETA, for the start-up span (and from there the report). The ETA is taken as the
    stages begin, right after the imports: time so far (from process creation, with marks) + the predicted stages."""
    attrs: dict[str, Any] = {Attr.CACHE_PATTERN: pattern_text(plan.pattern), Attr.ETA_BASIS: plan.basis}
    at_s = (begun_ns - marks.process_start_ns) / 1e9 if marks is not None else 0.0
    if plan.inputs is not None:
        attrs[Attr.ETA_INPUTS] = json.dumps(plan.inputs.to_json(), sort_keys=True)
    if plan.estimate is not None:
        stages_s = plan.estimate.total_s
        attrs.update(
            {
                Attr.ETA_FIRST_AT_S: round(at_s, 6),
                Attr.ETA_FIRST_STAGES_S: round(stages_s, 6),
                Attr.ETA_FIRST_READY_S: round(at_s + stages_s, 6),
                Attr.ETA_PHASES: json.dumps(plan.estimate.phases_json()),
            }
        )
    return attrs


def _planned(
    run: StartRun, pipeline: Sequence[Stage], plan: StartPlan | None, on_plan: Callable[[StartPlan], None] | None
) -> StartPlan:
    """The plan the stages run under, recorded on the start-up span: the caller's, else made here; after a bundle's
    install always made again (a plan made before could not see the hits it brings), and handed to `on_plan`."""
    bundle = run.ctx.config.bundle is not None
    if plan is None or bundle:
        # Under the root span: a damaged start-up profile found on the way is reported there (a cache_corrupt
        # event), as it was when only the write at READY read it.
        with trace.use_span(run.root, end_on_exit=False):
            plan = plan_start(run.ctx.config, run.ctx.cache_root, pipeline)
        if on_plan is not None and bundle:
            on_plan(plan)
    run.root.set_attributes(_eta_attributes(plan, run.marks, run.clock.now_ns()))
    return plan


def build_engine(
    config: EngineConfig,
    *,
    on_phase: Callable[[str], None] | None = None,
    tracing: Tracing | None = None,
    marks: ProcessMarks | None = None,
    stages: Sequence[Stage] | None = None,
    cache_dir: Path | None = None,
    plan: StartPlan | None = None,
    on_plan: Callable[[StartPlan], None] | None = None,
    parent: Any = None,
) -> StartupResult:
    """Run the start-up pipeline to READY. Raises StartupFailed (stage + one-line cause) when a stage fails.

    marks: the process's entry marks (`mark_main_entry()`); with them the root span starts at process creation and
        the table has the process_start / imports rows. Without them (library use) it starts at this call.
    plan: the cache pattern and ETA the caller made after its imports (`plan_start`, for its progress line);
        made here when not given. Recorded on the start-up span and, with this start's times, in the profile.
    on_plan: called with the plan made here after a bundle's install (`config.bundle`): a plan made before the
        install could not see the hits it brings, so it is made again, and the caller's ETA follows it.
    parent: an OpenTelemetry context whose span this start's root span hangs under: the server's start-up span,
        when this is its engine-core process (engine/core_proc.py). The pre-main spans are then the caller's (the
        server's and the core's own); `marks` still give the clock, the deferred collections and the floor's
        import time, and their process_start_ns is the server's creation, which the first ETA counts from.
    """
    check_device(config)  # first: `--device cuda` without CUDA fails deep in torch otherwise, naming no flag
    pipeline = list(stages) if stages is not None else default_stages(config)
    check_pipeline(pipeline, EngineContext)  # a bad declaration fails here, before the start-up span opens
    run = StartRun.open(
        config, cache_dir or cache_dir_from_env(), tracing or setup_tracing(in_memory=True), marks, parent
    )
    with run.running():
        if config.bundle is not None:
            run.install_bundle(on_phase)
        plan = _planned(run, pipeline, plan, on_plan)
        run.run(pipeline, on_phase)
    return _result(run, run.ready(plan, ready_hooks(config)), plan)


def _result(run: StartRun, ready: Any, plan: StartPlan) -> StartupResult:
    """What build_engine returns: the engine, the record of the start, and the model's facts the context held."""
    ctx = run.ctx
    assert ready.table is not None and ctx.kv_plan is not None and ctx.arch is not None and ctx.model_dir is not None
    return StartupResult(
        engine=ready.engine,
        stages=run.results,
        phase_table=ready.table,
        tracing=run.tracing,
        kv_plan=ctx.kv_plan,
        arch=ctx.arch,
        model_dir=ctx.model_dir,
        dtype=ctx.dtype,
        plan=plan,
        parallel=ctx.parallel,
    )
