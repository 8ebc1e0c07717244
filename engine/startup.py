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
from ..profiling.phases import Floor, PhaseTable, build_phase_table, with_rank_spread
from ..profiling.process import Clock, FullGcDeferral, ProcessMarks, open_startup_span
from ..profiling.tracing import RankAttributes, Tracing, setup_tracing, span_from_record, span_record
from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import STARTUP_PROFILE
from glowplug.base.artifacts.store import probes_seen
from glowplug.base.artifacts.cachedir import cache_dir_from_env

from .config import EngineConfig
from .config_check import check_device
from .distributed import DistributedError, TPGroup, step_payload, worker_trace_context
from .kv_sizing import KVPlan
from .llm_engine import LLMEngine
from .models.arch import ModelArch
from .models.store import model_group
from .parallel import launch_rank, tp_factors
from .stages.base import Stage, StageResult, StartupFailed, check_pipeline, plan_concurrency, run_stages, stage_dependencies
from .stages.bundle_install import BundleInstall
from .stages.distributed_init import DistributedInit
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
from .stages.grammar_init import GrammarInit
from .stages.warmup import Warmup
from .start_estimate import MISS, UNKNOWN, PhaseEstimate, StartRecord, pattern_text, profile_json, stage_caches
from .start_inputs import StartInputs, gather_inputs
from .start_profile import (
    PHASES,
    StartPlan,
    estimate_for,
    latest_probe,
    machine_records,
    profile_entries,
    profile_factors,
    read_records,
    this_machine,
    with_page_cache,
)

__all__ = ["PhaseEstimate", "StartPlan", "StartupFailed", "StartupResult", "build_engine", "default_stages",
           "estimate_phase_durations", "expected_phase_durations", "plan_start", "probe_cache_pattern"]


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


def _profile_factors(config: EngineConfig) -> dict[str, Any]:
    return profile_factors(config, config.resolved_device())


def _config_records(store: ArtifactStore, config: EngineConfig) -> list[StartRecord]:
    """This config's recorded starts, newest first (empty when none or unreadable)."""
    return store.lookup(STARTUP_PROFILE, _profile_factors(config), group=model_group(config.model), load=read_records).value or []


def expected_phase_durations(config: EngineConfig, cache_dir: Path | None = None) -> dict[str, float] | None:
    """Seconds per stage from the last successful start of this config, whatever its caches did, or None. The ETA
    uses `plan_start`, which picks the start with the same cache hits."""
    records = _config_records(ArtifactStore(cache_dir or cache_dir_from_env()), config)
    return dict(records[0].stages) if records else None


def probe_cache_pattern(config: EngineConfig, cache_dir: Path | None = None,
                        stages: Sequence[Stage] | None = None) -> dict[str, str]:  # fmt: skip
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


def plan_start(config: EngineConfig, cache_dir: Path | None = None,
               stages: Sequence[Stage] | None = None) -> StartPlan:  # fmt: skip
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
        inputs: StartInputs | None = gather_inputs(config, entries=hits, probe_gbps=latest_probe(machine_records(entries)))
        notes += inputs.notes if inputs is not None else []
    except Exception as exc:  # noqa: BLE001 - without inputs the model is left out; the records still serve
        log.info("start-up inputs unknown", error=repr(exc))
        notes.append(f"start-up inputs unknown ({exc})")
        inputs = None
    pattern = with_page_cache(pattern, inputs)
    deps = pipeline_waits(config, pipeline)
    try:
        estimate = estimate_for(config, store, config.resolved_device(), pattern, stage_caches(pipeline), deps,
                                inputs, entries)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - an unreadable profile costs the estimate only
        log.info("no start-up estimate", error=repr(exc))
        estimate = None
    return StartPlan(pattern, estimate, inputs, deps, keys, this_machine(), tuple(notes))


def estimate_phase_durations(config: EngineConfig, cache_dir: Path | None = None) -> PhaseEstimate | None:
    """The ETA's basis for `config` (see PhaseEstimate), or None when no start of this model was recorded."""
    return plan_start(config, cache_dir).estimate


def _record_phase_durations(ctx: EngineContext, results: list[StageResult], plan: StartPlan,
                            marks: ProcessMarks | None, before_s: float | None, probe_gbps: float | None) -> None:  # fmt: skip
    """Add this start to the config's start-up profile: its seconds per stage with its pattern, inputs and waits,
    keeping the latest start of each other pattern (start_estimate.profile_json)."""
    seconds = {r.name: r.seconds for r in results}
    ends = [r.end_ns for r in results if r.end_ns]
    starts = [r.start_ns for r in results if r.start_ns]
    wall = (max(ends) - min(starts)) / 1e9 if ends and starts else None
    new = StartRecord(seconds, dict(plan.pattern), wall, plan.inputs.to_json() if plan.inputs is not None else None,
                      {k: v for k, v in (plan.deps or {}).items() if k in seconds} or None, dict(plan.entries) or None,
                      plan.machine or None, model_group(ctx.config.model), before_s, probe_gbps,
                      (marks.imports_done_ns - marks.main_entry_ns) / 1e9
                      if marks is not None and marks.imports_done_ns is not None else None)  # fmt: skip
    store = ArtifactStore(ctx.cache_root)
    try:
        older = _config_records(store, ctx.config)
    except Exception:  # noqa: BLE001 - unreadable history: start it afresh
        older = []

    def build(folder: Path | None) -> None:
        if folder is not None:
            (folder / PHASES).write_text(json.dumps(profile_json(new, older)))

    try:
        # refresh: on a read-only cache dir the profile of this config's last start stays, silently (bookkeeping).
        store.put(STARTUP_PROFILE, _profile_factors(ctx.config), group=model_group(ctx.config.model), build=build, refresh=True)
    except Exception as exc:  # noqa: BLE001 - the engine is READY; a lost ETA record must not undo that
        structlog.get_logger("glowplug.startup").warning("start-up profile not recorded", error=repr(exc))


def _eta_attributes(plan: StartPlan, marks: ProcessMarks | None, begun_ns: int) -> dict[str, Any]:
    """The pattern and the first ETA, for the start-up span (and from there the report). The ETA is taken as the
    stages begin, right after the imports: time so far (from process creation, with marks) + the predicted stages."""
    attrs: dict[str, Any] = {Attr.CACHE_PATTERN: pattern_text(plan.pattern), Attr.ETA_BASIS: plan.basis}
    at_s = (begun_ns - marks.process_start_ns) / 1e9 if marks is not None else 0.0
    if plan.inputs is not None:
        attrs[Attr.ETA_INPUTS] = json.dumps(plan.inputs.to_json(), sort_keys=True)
    if plan.estimate is not None:
        stages_s = plan.estimate.total_s
        attrs.update({Attr.ETA_FIRST_AT_S: round(at_s, 6), Attr.ETA_FIRST_STAGES_S: round(stages_s, 6),
                      Attr.ETA_FIRST_READY_S: round(at_s + stages_s, 6),
                      Attr.ETA_PHASES: json.dumps(plan.estimate.phases_json())})  # fmt: skip
    return attrs


FLOOR_PROBE_BYTES = 256 << 20  # larger than the caches, small enough to add ~0.1 s after READY
FLOOR_PROBE_REPEATS = 3


def measure_floor(read_bytes: int, source: str, import_torch_s: float) -> Floor:
    """The floor of this config: the bytes it must read or map, read once at the measured read bandwidth, plus
    `import torch`. `source` says what the bytes are."""
    from glowplug.base.machine import measure_probe

    gbps = measure_probe(FLOOR_PROBE_REPEATS, FLOOR_PROBE_BYTES)
    return Floor(weights_bytes=read_bytes, read_gbps=round(gbps, 3), import_torch_s=import_torch_s, source=source)


def _floor_bytes(plan: StartPlan, results: Sequence[StageResult], weights_bytes: int) -> tuple[int, str]:
    """The bytes this start had to read or map: the model's files and the cache entries it loaded (the plan's
    inputs), else what the stages said they read, else the weights in memory (an over-count for a quantized file
    de-quantized on load, said so)."""
    if plan.inputs is not None and plan.inputs.get("read_bytes") > 0:
        weights, entries = plan.inputs.get("weights_bytes"), plan.inputs.get("entry_bytes")
        return int(weights + entries), (f"the model's files {weights / 1e9:.3f} GB + cache entries read "
                                        f"{entries / 1e9:.3f} GB")  # fmt: skip
    read = sum(int(v) for r in results if isinstance(v := r.report.attributes.get(Attr.BYTES_READ), (int, float)))
    if read > 0:
        return read, "bytes the stages read"
    return weights_bytes, "weights in memory (what was read is unknown)"


def _gather_rank_spans(group: TPGroup, tracing: Tracing, trace_id: int | None) -> dict[int, list[Any]]:
    """Every rank's start-up spans, on rank 0 (a collective: every rank calls it once at READY). Rank 0 keeps the
    workers' spans with its own, so its reports and trace files hold every rank under one trace id."""
    mine = [span_record(s) for s in tracing.finished_spans()
            if s.name.startswith(STARTUP_SPAN) and s.context is not None and s.context.trace_id == trace_id]
    gathered = group.gather_objects(mine)
    if group.rank != 0:
        return {}
    others = [span_from_record(r) for rank, records in enumerate(gathered) if rank != 0 for r in records]
    tracing.add_finished(others)
    return {rank: records for rank, records in enumerate(gathered)}


def _with_ranks(table: PhaseTable, ranks: dict[int, list[Any]], trace_id: int | None) -> PhaseTable:
    """Rank 0's table with every rank's row times (the slowest, the spread) and the rank that held READY back:
    the last to begin kv_cache_init, where each rank waits for all the others (engine/stages/kv_cache_init.py)."""
    per_rank: dict[int, PhaseTable] = {}
    arrivals: dict[int, int] = {}
    for rank, records in ranks.items():
        spans = [span_from_record(r) for r in records]
        try:
            per_rank[rank] = build_phase_table(spans, trace_id=trace_id, rank=rank)
        except ValueError:
            continue  # a rank without finished stage spans: nothing to compare
        for s in spans:
            if s.name == f"{STARTUP_SPAN}.{KVCacheInit.name}" and s.start_time is not None:
                arrivals[rank] = s.start_time
    return with_rank_spread(table, per_rank, arrivals, KVCacheInit.name)


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
    # Before anything else: `--device cuda` on a torch without CUDA would otherwise end in an AssertionError from
    # deep inside torch, with no flag named and no fix.
    check_device(config)
    pipeline = list(stages) if stages is not None else default_stages(config)
    check_pipeline(pipeline, EngineContext)  # a bad declaration fails here, before the start-up span opens
    tracing = tracing or setup_tracing(in_memory=True)
    tracer = tracing.tracer()
    ctx = EngineContext(config=config, cache_root=cache_dir or cache_dir_from_env(), device=config.resolved_device())
    clock = marks.clock if marks is not None else Clock()
    # The root span is ours in both modes so that work after READY (the start-up profile, sealing the compile
    # cache) still has a span to report cache events on.
    if parent is not None:
        root = tracer.start_span(STARTUP_SPAN, start_time=clock.now_ns(), context=parent,
                                 attributes={Attr.SCHEMA_VERSION: SCHEMA_VERSION})  # fmt: skip
    elif marks is not None:
        root = open_startup_span(tracer, marks)
    else:
        root = tracer.start_span(STARTUP_SPAN, start_time=clock.now_ns(), attributes={Attr.SCHEMA_VERSION: SCHEMA_VERSION},
                                 context=worker_trace_context())  # fmt: skip
    if config.tensor_parallel_size > 1:
        # Every rank's spans go into one trace (a worker's root hangs under rank 0's distributed_init): each says
        # which rank it is.
        root.set_attributes({Attr.RANK: launch_rank(), Attr.WORLD_SIZE: config.tensor_parallel_size})
        tracing.provider.add_span_processor(RankAttributes(launch_rank(), config.tensor_parallel_size))
    deferral = FullGcDeferral.start()  # see FullGcDeferral; the process entry may have started one already
    try:
        installed: list[StageResult] = []
        if config.bundle is not None:
            # First, and alone: the stages' cache probes (the plan) and the stages must see what it installs.
            first = EngineContext(config=config, cache_root=ctx.cache_root, device=ctx.device)
            installed = run_stages([BundleInstall()], first, tracer=tracer, on_phase=on_phase, parent=root,
                                   clock=clock)  # fmt: skip
            config = config.model_copy(update={"model": first.bundle.model})
            ctx = EngineContext(config=config, cache_root=ctx.cache_root, device=ctx.device)
            plan = None
        if plan is None:
            # Under the root span: a damaged start-up profile found on the way is reported there (a cache_corrupt
            # event), as it was when only the write at READY read it.
            with trace.use_span(root, end_on_exit=False):
                plan = plan_start(config, ctx.cache_root, pipeline)
            if on_plan is not None and config.bundle is not None:
                on_plan(plan)
        root.set_attributes(_eta_attributes(plan, marks, clock.now_ns()))
        results = installed + run_stages(
            pipeline,
            ctx,
            tracer=tracer,
            on_phase=on_phase,
            parent=root,
            clock=clock,
        )
    except StartupFailed as failed:
        from opentelemetry.trace import Status, StatusCode

        if ctx.parallel is not None:
            # A rank that died shows here as whatever collective noticed first: name the rank instead.
            rank_failure = ctx.parallel.failure()
            ctx.parallel.close()
            if rank_failure is not None:
                failed = StartupFailed(failed.stage, DistributedError(rank_failure))
        root.set_status(Status(StatusCode.ERROR, str(failed)))
        root.set_attribute(Attr.ERROR, str(failed))
        root.end(end_time=clock.now_ns())
        raise failed from failed.cause
    finally:
        deferral.resume()
        if marks is not None and marks.gc_deferral is not None:
            marks.gc_deferral.resume(freeze=ctx.engine is not None)
    ready_ns = clock.now_ns()
    engine = ctx.engine
    assert engine is not None, "the pipeline ended without building an engine (is kv_cache_init in it?)"
    assert ctx.kv_plan is not None and ctx.arch is not None and ctx.model_dir is not None
    # After READY, so it costs the start nothing: the floor needs the import time the CLI measured, and its probe
    # is recorded with the start (the next start's inputs take it).
    floor = (measure_floor(*_floor_bytes(plan, results, ctx.weights_bytes), marks.import_torch_s)
             if marks is not None and marks.import_torch_s is not None else None)  # fmt: skip
    # Process creation -> the first stage: what a prediction made before starting adds to the stages.
    begun = [r.start_ns for r in results if r.name != BundleInstall.name]
    before_s = (clock.wall_ns(min(begun)) - marks.process_start_ns) / 1e9 if marks is not None and begun else None
    with trace.use_span(root, end_on_exit=False):
        # The install is not a phase a later start repeats (its entries are then present): not recorded.
        _record_phase_durations(ctx, [r for r in results if r.name != BundleInstall.name], plan, marks, before_s,
                                floor.read_gbps if floor is not None else None)  # fmt: skip
        if ctx.compile_cache is not None:
            ctx.compile_cache.seal()  # graphs compiled after graph_compile (capture) join the verified cache
    root.end(end_time=ready_ns)
    trace_id = results[0].span_context.trace_id if results else None
    group: TPGroup | None = ctx.parallel
    ranks = _gather_rank_spans(group, tracing, trace_id) if group is not None else {}
    table = build_phase_table(
        [s for s in tracing.finished_spans() if s.name.startswith(STARTUP_SPAN)],
        ready_time_ns=ready_ns,
        trace_id=trace_id,
        floor=floor,
        rank=launch_rank() if config.tensor_parallel_size > 1 else 0,
    )
    if len(ranks) > 1:
        table = _with_ranks(table, ranks, trace_id)
    # The context ends here: the result takes the engine and plain facts, so nothing the stages held (the state
    # dict's extra references, the trace, the compile cache) outlives the start-up through it.
    if group is not None and group.rank == 0:
        # From now on every eager step of rank 0 is run by every rank (engine/distributed.py).
        engine.runner.broadcast_steps(lambda b: group.send_step(step_payload(b.input_ids, b.positions, b.meta,
                                                                                b.sample_rows)))  # fmt: skip
        group.serving = True
    return StartupResult(engine=engine, stages=results, phase_table=table, tracing=tracing, kv_plan=ctx.kv_plan,
                         arch=ctx.arch, model_dir=ctx.model_dir, dtype=ctx.dtype, plan=plan,
                         parallel=group)  # fmt: skip
