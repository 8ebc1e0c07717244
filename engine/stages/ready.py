"""The work at READY, as hooks under the stage protocol: measure the floor, record this start in the start-up
profile, seal the compile cache, end the start-up span and build the phase table, and (rank 0 of a tensor-parallel
group) start broadcasting steps.

They run after the pipeline, one after another in list order (`run_in_order`), each under its needs/provides
contract on a `ReadyContext`, and without spans of their own: READY is taken before them, so they are no phase of
the start and add no row; what they find on the way (a damaged start-up profile) is reported on the start-up span.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import STARTUP_PROFILE
from glowplug.engine.compile_cache import CompileCache
from glowplug.engine.config import EngineConfig
from glowplug.engine.distributed import TPGroup
from glowplug.engine.llm_engine import LLMEngine
from glowplug.engine.models.store import model_group
from glowplug.engine.parallel import launch_rank
from glowplug.engine.start_profile import PHASES, StartPlan, lookup_records, profile_factors
from glowplug.engine.start_record import StartRecord, profile_json
from glowplug.engine.tp_step import step_payload
from glowplug.profiling.names import STARTUP_SPAN, Attr
from glowplug.profiling.phases import Floor, PhaseTable, build_phase_table, with_rank_spread
from glowplug.profiling.process import Clock, ProcessMarks
from glowplug.profiling.tracing import Tracing, span_from_record, span_record

from .bundle_install import BundleInstall
from .kv_cache_init import KVCacheInit
from .protocol import Stage, StageReport, StageResult, StartupContext


@dataclass
class ReadyContext(StartupContext):
    """What the start left at READY (the inputs), and what the hooks hand on (the slots)."""

    INPUTS: ClassVar[frozenset[str]] = frozenset(
        {
            "config",
            "cache_root",
            "plan",
            "marks",
            "clock",
            "root",
            "tracing",
            "results",
            "ready_ns",
            "engine",
            "weights_bytes",
            "compile_cache",
            "parallel",
        }
    )

    config: EngineConfig
    cache_root: Path
    plan: StartPlan
    marks: ProcessMarks | None  # the process's entry marks; None in library use
    clock: Clock
    root: Span  # the start-up span, still open
    tracing: Tracing
    results: list[StageResult]  # every stage that ran, the bundle's install included
    ready_ns: int  # READY on the spans' clock
    engine: LLMEngine
    weights_bytes: int
    compile_cache: CompileCache | None
    parallel: TPGroup | None
    floor: Floor | None = None  # measure_floor
    table: PhaseTable | None = None  # phase_table


def ready_hooks(config: EngineConfig | None = None) -> list[Stage]:
    """The hooks at READY, in the order they run; with `config` asking for tensor parallelism, serve_steps last."""
    parallel: list[Stage] = [ServeSteps()] if config is not None and config.tensor_parallel_size > 1 else []
    return [MeasureFloor(), RecordProfile(), SealCompileCache(), PhaseTableAtReady(), PrepareGrammar(), *parallel]


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
        return int(weights + entries), (
            f"the model's files {weights / 1e9:.3f} GB + cache entries read {entries / 1e9:.3f} GB"
        )
    read = sum(int(v) for r in results if isinstance(v := r.report.attributes.get(Attr.BYTES_READ), (int, float)))
    if read > 0:
        return read, "bytes the stages read"
    return weights_bytes, "weights in memory (what was read is unknown)"


class MeasureFloor:
    """After READY, so it costs the start nothing: the floor needs the import time the CLI measured, and its probe
    is recorded with the start (the next start's inputs take it)."""

    name = "measure_floor"
    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ("floor",)

    def run(self, ctx: ReadyContext) -> StageReport:
        marks = ctx.marks
        if marks is None or marks.import_torch_s is None:
            return StageReport.skipped("no import time measured (library use)")
        ctx.floor = measure_floor(*_floor_bytes(ctx.plan, ctx.results, ctx.weights_bytes), marks.import_torch_s)
        return StageReport()


def _record_phase_durations(
    ctx: ReadyContext,
    results: list[StageResult],
    plan: StartPlan,
    before_s: float | None,
    probe_gbps: float | None,
    imports_s: float | None,
    tail_s: float | None,
) -> None:
    """Add this start to the config's start-up profile: its seconds per stage with its pattern, inputs and waits,
    keeping the latest start of each other pattern (start_record.profile_json)."""
    seconds = {r.name: r.seconds for r in results}
    ends = [r.end_ns for r in results if r.end_ns]
    starts = [r.start_ns for r in results if r.start_ns]
    wall = (max(ends) - min(starts)) / 1e9 if ends and starts else None
    new = StartRecord(
        seconds,
        dict(plan.pattern),
        wall,
        plan.inputs.to_json() if plan.inputs is not None else None,
        {k: v for k, v in (plan.deps or {}).items() if k in seconds} or None,
        dict(plan.entries) or None,
        plan.machine or None,
        model_group(ctx.config.model),
        before_s,
        probe_gbps,
        imports_s,
        tail_s,
    )
    store = ArtifactStore(ctx.cache_root)
    try:
        older = lookup_records(store, ctx.config)
    except Exception:  # noqa: BLE001 - unreadable history: start it afresh
        older = []

    def build(folder: Path | None) -> None:
        if folder is not None:
            (folder / PHASES).write_text(json.dumps(profile_json(new, older)))

    try:
        # refresh: on a read-only cache dir the profile of this config's last start stays, silently (bookkeeping).
        store.put(
            STARTUP_PROFILE,
            profile_factors(ctx.config, ctx.config.resolved_device()),
            group=model_group(ctx.config.model),
            build=build,
            refresh=True,
        )
    except Exception as exc:  # noqa: BLE001 - the engine is READY; a lost ETA record must not undo that
        structlog.get_logger("glowplug.startup").warning("start-up profile not recorded", error=repr(exc))


class RecordProfile:
    """This start's seconds per stage, pattern and inputs, into the config's start-up profile (the next start's
    ETA). The install of a bundle is not a phase a later start repeats (its entries are then present): not
    recorded."""

    name = "record_profile"
    needs: tuple[str, ...] = ("floor",)
    provides: tuple[str, ...] = ()

    def run(self, ctx: ReadyContext) -> StageReport:
        results, marks, floor = ctx.results, ctx.marks, ctx.floor
        # Process creation -> the first stage: what a prediction made before starting adds to the stages.
        begun = [r.start_ns for r in results if r.name != BundleInstall.name]
        before_s = (
            (ctx.clock.wall_ns(min(begun)) - marks.process_start_ns) / 1e9 if marks is not None and begun else None
        )
        # Main entry -> the first stage of any kind (the imports, then the plan): what a server waits for after it
        # starts a core, before the core's first stage.
        first = [r.start_ns for r in results if r.start_ns]
        imports_s = (ctx.clock.wall_ns(min(first)) - marks.main_entry_ns) / 1e9 if marks is not None and first else None
        ends = [r.end_ns for r in results if r.end_ns]
        tail_s = max(0.0, (ctx.ready_ns - ctx.clock.wall_ns(max(ends))) / 1e9) if ends else None
        with trace.use_span(ctx.root, end_on_exit=False):
            _record_phase_durations(
                ctx,
                [r for r in results if r.name != BundleInstall.name],
                ctx.plan,
                before_s,
                floor.read_gbps if floor is not None else None,
                imports_s,
                tail_s,
            )
        return StageReport()


class SealCompileCache:
    """Graphs compiled after graph_compile (capture) join the verified cache."""

    name = "seal_compile_cache"
    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()

    def run(self, ctx: ReadyContext) -> StageReport:
        if ctx.compile_cache is None:
            return StageReport.skipped("no compile cache")
        with trace.use_span(ctx.root, end_on_exit=False):
            ctx.compile_cache.seal()
        return StageReport()


def _gather_rank_spans(group: TPGroup, tracing: Tracing, trace_id: int | None) -> dict[int, list[Any]]:
    """Every rank's start-up spans, on rank 0 (a collective: every rank calls it once at READY). Rank 0 keeps the
    workers' spans with its own, so its reports and trace files hold every rank under one trace id."""
    mine = [
        span_record(s)
        for s in tracing.finished_spans()
        if s.name.startswith(STARTUP_SPAN) and s.context is not None and s.context.trace_id == trace_id
    ]
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


class PhaseTableAtReady:
    """End the start-up span at READY and build the phase table from the finished spans: under tensor
    parallelism every rank's (a collective), with rank 0's table showing the spread."""

    name = "phase_table"
    needs: tuple[str, ...] = ("floor",)
    provides: tuple[str, ...] = ("table",)

    def run(self, ctx: ReadyContext) -> StageReport:
        ctx.root.end(end_time=ctx.ready_ns)
        results, tracing, group = ctx.results, ctx.tracing, ctx.parallel
        trace_id = results[0].span_context.trace_id if results else None
        ranks = _gather_rank_spans(group, tracing, trace_id) if group is not None else {}
        table = build_phase_table(
            [s for s in tracing.finished_spans() if s.name.startswith(STARTUP_SPAN)],
            ready_time_ns=ctx.ready_ns,
            trace_id=trace_id,
            floor=ctx.floor,
            rank=launch_rank() if ctx.config.tensor_parallel_size > 1 else 0,
        )
        if len(ranks) > 1:
            table = _with_ranks(table, ranks, trace_id)
        ctx.table = table
        return StageReport()


class ServeSteps:
    """Rank 0 of a tensor-parallel group: from now on every eager step of rank 0 is run by every rank
    (engine/distributed.py)."""

    name = "serve_steps"
    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()

    def run(self, ctx: ReadyContext) -> StageReport:
        group = ctx.parallel
        if group is None or group.rank != 0:
            return StageReport.skipped("not rank 0 of a tensor-parallel group")
        ctx.engine.runner.broadcast_steps(
            lambda b: group.send_step(step_payload(b.input_ids, b.positions, b.meta, b.sample_rows))
        )
        group.serving = True
        return StageReport()


class PrepareGrammar:
    """After READY: the grammar backend's tokenizer view (GrammarBackend.prepare) built on a thread of its own, so
    that the start does not wait for it (engine/stages/grammar_init.py says why); a constrained request that comes
    first waits on the backend's lock for the rest of the build."""

    name = "prepare_grammar"
    needs: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()

    def run(self, ctx: ReadyContext) -> StageReport:
        import threading

        backend = ctx.engine.core.grammar if ctx.engine is not None else None
        if backend is not None:
            threading.Thread(target=backend.prepare, name="glowplug-grammar-prepare", daemon=True).start()
        return StageReport()
