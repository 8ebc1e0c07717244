"""The start-up phase table, built from finished spans only, and its renderers (rich, Markdown, CSV, JSON).

Row definitions (names from vLLM's start-up table where it has one; see `names.py`):
  leaves       process_start, imports, then (a start whose engine core is a process of its own, `glowplug serve`)
               core_process_start and core_imports, then one row per stage span (`glowplug.startup.<stage>`); a
               stage books to its default row or to the row its report chose (graph_compile: general_shape on a miss,
               cached on a hit). A leaf whose phase did not run is None with a reason.
  unattributed actual_total_time - (sum(leaves) - overlap): wall time no phase claims.
               Leaves + unattributed - overlap == actual_total_time exactly (computed in integer ns).
  aggregates   model_loading = model_prepare + load_weights + model_init + quantize_weights
               torch.compile = native_kernels + dynamo_transform_time + graph_compile_general_shape
                               + graph_compile_cached
               init_engine   = kv_cache_profiling + kv_cache_init + graph_capturing + warmup
               An aggregate is a sum of own times: when its stages overlapped, it is more than the wall time they
               took. Never add aggregates to leaves (or to each other): each leaf is in exactly one aggregate.
  derived      overlap       = sum of the booked stage times - the wall time those stages covered together (the
                               union of their intervals): the seconds saved by running stages at once. 0 when
                               the pipeline ran one stage at a time.
               critical_path = the longest chain of stages that waited on each other (own times, from each span's
                               `glowplug.waits_for`): no amount of overlap makes the stages faster than this.
  totals       total_time = sum of all stage spans (pre-main excluded; skipped and failed stages included)
               actual_total_time = process creation (the process_start span's start) -> READY (wall time)
  floor        weights bytes / a read-bandwidth probe + `import torch`, when the caller measured it; its note
               gives actual/floor.
A stage reported as skipped contributes no leaf time (its few µs fall into unattributed) and shows its reason; a
stage that hit its cache ran (it read the cache): its time is booked to its row, with the note "cache hit".
"""

from __future__ import annotations

import csv
import io
import json
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode, format_trace_id
from rich import box
from rich.table import Table

from glowplug.profiling.names import (
    AGGREGATE_ROWS,
    CORE_ROWS,
    LEAF_ROWS,
    NOTED_EVENTS,
    PRE_MAIN,
    SCHEMA_VERSION,
    STAGE_ALTERNATIVE_ROWS,
    STAGE_ROWS,
    STARTUP_SPAN,
    Attr,
    Row,
    stage_from_span_name,
)

Kind = Literal["leaf", "aggregate", "derived", "total", "floor"]
CACHE_HIT_NOTE = "cache hit"
REPORT_SUFFIXES = (".md", ".csv", ".json")
NOT_IN_PIPELINE = "not in pipeline"
NO_PROCESS_MARKS = "no process marks (mark_main_entry() not used)"


@dataclass(frozen=True)
class PhaseRow:
    name: str
    kind: Kind
    nanos: int | None
    reason: str | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)
    components: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # cache events and miss reasons of the stage(s) booked here

    @property
    def seconds(self) -> float | None:
        return None if self.nanos is None else self.nanos / 1e9


@dataclass(frozen=True)
class PhaseTable:
    rows: tuple[PhaseRow, ...]
    versions: Mapping[str, str]
    trace_id: str | None = None
    schema: str = SCHEMA_VERSION

    def __getitem__(self, name: str) -> PhaseRow:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row {name!r}; rows are {', '.join(r.name for r in self.rows)}")

    def seconds(self, name: str) -> float | None:
        return self[name].seconds

    @property
    def leaves(self) -> tuple[PhaseRow, ...]:
        """The leaf rows including unattributed: they add up to actual_total_time."""
        return tuple(r for r in self.rows if r.kind == "leaf")

    @property
    def actual_total_time(self) -> float:
        return self[Row.ACTUAL_TOTAL_TIME].nanos / 1e9  # type: ignore[operator]


def current_versions() -> dict[str, str]:
    """Versions that explain a start-up time; read from package metadata so torch is not imported for this."""

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "glowplug": version("glowplug"),
        "schema": SCHEMA_VERSION,
    }


# ---------------------------------------------------------------- building


def _is_startup(span: ReadableSpan) -> bool:
    return span.name == STARTUP_SPAN or stage_from_span_name(span.name) is not None


def _select_trace(spans: Sequence[ReadableSpan], trace_id: int | None) -> list[ReadableSpan]:
    by_trace: dict[int, list[ReadableSpan]] = {}
    for span in spans:
        if _is_startup(span) and span.context is not None and span.end_time is not None:
            by_trace.setdefault(span.context.trace_id, []).append(span)
    if not by_trace:
        raise ValueError(f"no finished {STARTUP_SPAN}* spans among the {len(spans)} given")
    if trace_id is not None:
        if trace_id not in by_trace:
            raise ValueError(f"trace {format_trace_id(trace_id)} has no finished {STARTUP_SPAN}* spans")
        return by_trace[trace_id]
    # Several start-ups in one exporter (tests, benchmarks): the latest one is the one being asked about.
    return max(by_trace.values(), key=lambda group: max(s.start_time or 0 for s in group))


def _default_row(stage: str, attributes: Mapping[str, Any]) -> str:
    alternatives = STAGE_ALTERNATIVE_ROWS.get(stage)
    if alternatives and attributes.get(Attr.CACHE_HIT) is True:
        return alternatives[-1]  # the cached variant is listed last
    return STAGE_ROWS.get(stage, stage)


def _hit_note(attributes: Mapping[str, Any]) -> str:
    bundle = attributes.get(Attr.CACHE_FROM_BUNDLE)
    return f"cache hit from bundle {bundle}" if bundle else CACHE_HIT_NOTE


def _alternative_reason(chosen: str, attributes: Mapping[str, Any]) -> str:
    if chosen.endswith("_cached"):
        return _hit_note(attributes)
    miss = attributes.get(Attr.CACHE_MISS_REASON)
    return f"cache miss: {miss}" if miss else "cache miss"


Outcome = Literal["ran", "skipped", "failed"]


@dataclass(frozen=True)
class SpanPhase:
    """One finished stage span as the phase table reads it: the row it books to, what happened, and why.

    The table and the live start-up page (`glowplug.lifecycle.events`) both go through `span_phase`, so a bar on
    the page and a cell of the table can never disagree about a span.
    """

    stage: str
    row: str
    start_ns: int
    end_ns: int
    outcome: Outcome
    reason: str | None  # the table's note for `row`: "failed: ...", the skip reason, else None
    attributes: Mapping[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()  # cache events on the span (`cache_corrupt`, `cache_unusable`), one line each

    @property
    def nanos(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def booked_nanos(self) -> int | None:
        """What the span adds to its row: nothing when skipped (its few µs fall into unattributed)."""
        return None if self.outcome == "skipped" else self.nanos

    @property
    def note(self) -> str | None:
        """The reason, else the cache events, else the cache outcome ("cache hit", "cache miss: <why>")."""
        if self.reason is not None:
            return self.reason
        if self.events:
            return "; ".join(self.events)
        hit = self.attributes.get(Attr.CACHE_HIT)
        if hit is True:
            return _hit_note(self.attributes)
        if hit is False:
            miss = self.attributes.get(Attr.CACHE_MISS_REASON)
            return f"cache miss: {miss}" if miss else "cache miss"
        return None


def span_phase(span: ReadableSpan) -> SpanPhase:
    """How the phase table books one finished `glowplug.startup.<stage>` span."""
    stage = stage_from_span_name(span.name) or span.name
    attrs = dict(span.attributes or {})
    row = stage if stage in PRE_MAIN else str(attrs.get(Attr.ROW) or _default_row(stage, attrs))
    skipped = attrs.get(Attr.SKIPPED_REASON)
    outcome: Outcome
    if span.status.status_code is StatusCode.ERROR:
        outcome, reason = "failed", f"failed: {span.status.description or attrs.get(Attr.ERROR, 'error')}"
    elif skipped == CACHE_HIT_NOTE:
        # Reading a cache is work of the stage's own: its time belongs to its row, not to unattributed.
        outcome, reason = "ran", None
        attrs.setdefault(Attr.CACHE_HIT, True)
    elif skipped:
        outcome, reason = "skipped", str(skipped)
    else:
        outcome, reason = "ran", None
    return SpanPhase(stage, row, span.start_time or 0, span.end_time or 0, outcome, reason, attrs, event_notes(span))


def event_notes(span: ReadableSpan) -> tuple[str, ...]:
    """One line per cache event on the span: `cache_corrupt (quant): <reason> -> rebuilding`."""
    out = []
    for ev in span.events:
        if ev.name in NOTED_EVENTS:
            a = ev.attributes or {}
            action = str(a.get(Attr.CACHE_ACTION, "")).split(";")[-1].strip()
            out.append(
                f"{ev.name} ({a.get(Attr.CACHE_NAME, '?')}): {a.get(Attr.CACHE_REASON, '')}"
                + (f" -> {action}" if action else "")
            )
    return tuple(out)


def _row_notes(phase: SpanPhase) -> list[str]:
    """A row's notes: the stage's cache events, else the miss reason of a stage that ran (graph_compile says its
    own on the alternative row; a cache event already explains its miss)."""
    own = [str(phase.attributes[Attr.ROW_NOTE])] if phase.outcome == "ran" and Attr.ROW_NOTE in phase.attributes else []
    if phase.events or phase.outcome != "ran" or phase.stage in STAGE_ALTERNATIVE_ROWS:
        return [*phase.events, *own]
    if phase.attributes.get(Attr.CACHE_HIT) is True:
        return [_hit_note(phase.attributes), *own]
    miss = phase.attributes.get(Attr.CACHE_MISS_REASON)
    return ([f"cache miss: {miss}"] if miss and phase.attributes.get(Attr.CACHE_HIT) is False else []) + own


# A row that took longer than this says in its note what it did with the time (`work_note`).
EXPLAIN_ABOVE_S = 0.5


def _gb(value: Any) -> str:
    return f"{float(value) / 1e9:.3f} GB"


def _count(attrs: Mapping[str, Any], key: str) -> int:
    value = attrs.get(key)
    return int(value) if isinstance(value, (int, float)) else 0


def work_note(stage: str, attrs: Mapping[str, Any], seconds: float) -> str:
    """What a stage did with its time, from its span's attributes: bytes and rate for a read, layers for a switch,
    the entry for a cache hit. Every stage that reports such attributes gets its phrase; one that reports none
    says so, so a slow row is never silent."""
    parts: list[str] = []
    read = attrs.get(Attr.BYTES_READ)
    if isinstance(read, (int, float)) and read > 0:
        parts.append(f"read {_gb(read)} at {read / 1e9 / max(seconds, 1e-9):.3f} GB/s")
    native = {
        "dense": Attr.NATIVE_DENSE_LAYERS,
        "quantized": Attr.NATIVE_QUANTIZED_LAYERS,
        "attention": Attr.NATIVE_ATTENTION_LAYERS,
    }
    layers = {k: _count(attrs, key) for k, key in native.items()}
    if any(layers.values()):
        parts.append("switched " + ", ".join(f"{n} {k}" for k, n in layers.items() if n) + " layers to native kernels")
    if _count(attrs, Attr.TRITON_DECODE_LAYERS):
        parts.append(f"switched {_count(attrs, Attr.TRITON_DECODE_LAYERS)} layers to Triton ops")
    if _count(attrs, Attr.WEIGHTS_BYTES):
        parts.append(f"built the model over {_gb(attrs[Attr.WEIGHTS_BYTES])} of weights")
    if _count(attrs, Attr.QUANTIZED_BYTES) and stage == "quantize_weights":
        parts.append(f"{_gb(attrs[Attr.QUANTIZED_BYTES])} of quantized weights")
    if _count(attrs, Attr.GRAPH_NODES):
        parts.append(f"traced {_count(attrs, Attr.GRAPH_NODES)} graph nodes")
    if _count(attrs, Attr.KERNELS_BUILT):
        parts.append(f"built {_count(attrs, Attr.KERNELS_BUILT)} kernels")
    sizes, warmed = attrs.get(Attr.GRAPH_SIZES), attrs.get(Attr.GRAPH_WARMED_SIZES)
    if isinstance(warmed, (list, tuple)) and isinstance(sizes, (list, tuple)) and sizes:
        parts.append(f"checked {len(sizes)} batch sizes, ran the step at {len(warmed)}")
    elif isinstance(sizes, (list, tuple)) and sizes:
        parts.append(f"ran the step at {len(sizes)} batch sizes")
    if _count(attrs, Attr.VOCAB_SIZE):
        parts.append(f"{_count(attrs, Attr.VOCAB_SIZE):,}-token vocabulary")
    if _count(attrs, Attr.KV_CACHE_BYTES):
        parts.append(f"allocated a {_gb(attrs[Attr.KV_CACHE_BYTES])} KV pool")
    if _count(attrs, Attr.WARMUP_TOKENS):
        parts.append(f"generated {_count(attrs, Attr.WARMUP_TOKENS)} tokens")
    if attrs.get(Attr.CACHE_HIT) is True and attrs.get(Attr.CACHE_KEY):
        parts.append(f"loaded cache entry {attrs[Attr.CACHE_KEY]}")
    elif attrs.get(Attr.CACHE_HIT) is False and attrs.get(Attr.CACHE_KEY):
        parts.append(f"built cache entry {attrs[Attr.CACHE_KEY]}")
    delay = attrs.get(Attr.TEST_DELAY_S)
    if isinstance(delay, (int, float)) and delay > 0:
        parts.append(f"{delay:g} s planted by GLOWPLUG_TEST_STAGE_DELAY")
    return "; ".join(parts) if parts else "this stage reports no breakdown of its time"


_ROOT_ETA_ATTRS = (
    Attr.CACHE_PATTERN,
    Attr.ETA_BASIS,
    Attr.ETA_FIRST_AT_S,
    Attr.ETA_FIRST_STAGES_S,
    Attr.ETA_FIRST_READY_S,
    Attr.ETA_PHASES,
    Attr.ETA_INPUTS,
)


def _root_eta(roots: Sequence[ReadableSpan]) -> dict[str, Any]:
    """The start's cache pattern and first ETA (set on the start-up span), beside the actual time they predicted."""
    return {k: v for r in roots for k, v in (r.attributes or {}).items() if k in _ROOT_ETA_ATTRS}


def build_phase_table(
    spans: Sequence[ReadableSpan],
    *,
    ready_time_ns: int | None = None,
    trace_id: int | None = None,
    versions: Mapping[str, str] | None = None,
    floor: Floor | None = None,
    rank: int = 0,
) -> PhaseTable:
    """The phase table of one start-up (the latest in `spans` unless `trace_id` picks one).

    rank: under tensor parallelism every rank's spans share the trace; the table is this rank's (spans without a
        `rank` attribute are rank 0's). `with_rank_spread` adds what the other ranks did to it.

    floor: the measured floor for this config (see `Floor`); the table then ends with it and actual/floor.

    ready_time_ns: wall-clock ns (same time line as the spans, e.g. `ProcessMarks.clock.now_ns()`) at READY;
        default: the end of the root `glowplug.startup` span, else of the last stage span.
    """
    group = sorted(
        (s for s in _select_trace(spans, trace_id) if (s.attributes or {}).get(Attr.RANK, 0) == rank),
        key=lambda s: s.start_time or 0,
    )
    roots = [s for s in group if s.name == STARTUP_SPAN]
    stage_spans = [s for s in group if s.name != STARTUP_SPAN]

    leaf_ns: dict[str, int] = {}
    reasons: dict[str, str] = {}
    notes: dict[str, list[str]] = {}
    attributes: dict[str, dict[str, Any]] = {}
    extra_rows: list[str] = []  # stages the vocabulary does not know yet, in order of appearance
    total_ns = 0
    booked: list[tuple[int, int]] = []  # intervals of the stage spans whose time is booked to a leaf
    chain_spans: list[SpanPhase] = []
    for span in stage_spans:
        phase = span_phase(span)
        stage, row, attrs = phase.stage, phase.row, phase.attributes
        if stage not in PRE_MAIN:
            total_ns += phase.nanos
            chain_spans.append(phase)
            if phase.booked_nanos is not None:
                booked.append((phase.start_ns, phase.end_ns))
        if row not in LEAF_ROWS and row not in CORE_ROWS and row not in extra_rows:
            extra_rows.append(row)
        attributes.setdefault(row, {}).update(attrs)
        notes.setdefault(row, []).extend(_row_notes(phase))
        if phase.outcome == "ran" and stage not in PRE_MAIN and phase.nanos > EXPLAIN_ABOVE_S * 1e9:
            notes[row].append(work_note(stage, attrs, phase.nanos / 1e9))
        if phase.booked_nanos is not None:
            leaf_ns[row] = leaf_ns.get(row, 0) + phase.booked_nanos
        if phase.reason is not None:
            reasons[row] = phase.reason
        for other in STAGE_ALTERNATIVE_ROWS.get(stage, ()):
            if other != row:
                reasons.setdefault(
                    other, phase.reason if phase.outcome == "skipped" else _alternative_reason(row, attrs)
                )

    pre = [s for s in stage_spans if stage_from_span_name(s.name) == Row.PROCESS_START]
    starts = [s.start_time or 0 for s in (pre or roots or stage_spans)]
    start_ns = min(starts)
    last_end = max(s.end_time or 0 for s in stage_spans) if stage_spans else start_ns
    if ready_time_ns is None:
        ready_time_ns = max(s.end_time or 0 for s in roots) if roots else last_end
    if ready_time_ns < last_end:
        raise ValueError(
            f"ready_time_ns is {(last_end - ready_time_ns) / 1e9:.6f} s before the last start-up span ends; "
            "pass a time taken at READY on the spans' clock"
        )
    actual_ns = ready_time_ns - start_ns

    rows: list[PhaseRow] = []
    at = LEAF_ROWS.index(Row.IMPORTS) + 1
    core = tuple(r for r in CORE_ROWS if r in leaf_ns or r in reasons)  # a served start's core process rows
    for name in (*LEAF_ROWS[:at], *core, *LEAF_ROWS[at:], *extra_rows):
        nanos = leaf_ns.get(name)
        reason = reasons.get(name)
        if nanos is None and reason is None:
            reason = NO_PROCESS_MARKS if name in PRE_MAIN else NOT_IN_PIPELINE
        rows.append(PhaseRow(name, "leaf", nanos, reason, attributes.get(name, {}), notes=tuple(notes.get(name, ()))))
    overlap_ns = sum(e - b for b, e in booked) - _union_ns(booked)
    unattributed = actual_ns - sum(r.nanos for r in rows if r.nanos is not None) + overlap_ns
    rows.append(PhaseRow(Row.UNATTRIBUTED, "leaf", unattributed))

    by_name = {r.name: r for r in rows}
    aggregates: list[PhaseRow] = []
    for name, parts in AGGREGATE_ROWS.items():
        values = [n for n in (by_name[p].nanos for p in parts) if n is not None]
        if values:
            aggregates.append(PhaseRow(name, "aggregate", sum(values), components=parts))
        else:
            # Phases a custom pipeline leaves out say nothing about why the others did not run.
            part_reasons = {by_name[p].reason for p in parts} - {NOT_IN_PIPELINE} or {NOT_IN_PIPELINE}
            reason = part_reasons.pop() if len(part_reasons) == 1 else "none of its phases ran"
            aggregates.append(PhaseRow(name, "aggregate", None, reason, components=parts))
    # Cache events of the work around the stages (e.g. the start-up profile written at READY) are on the root.
    root_notes = tuple(n for r in roots for n in event_notes(r))
    path_ns, path = _critical_path(chain_spans)
    derived = [
        PhaseRow(
            Row.OVERLAP,
            "derived",
            overlap_ns,
            "stages that ran at once: sum of their own times - the wall "
            "time they covered; leaves + unattributed - overlap = actual_total_time",
        ),
        PhaseRow(Row.CRITICAL_PATH, "derived", path_ns, " -> ".join(path) if path else "no stages"),
    ]
    totals = [
        PhaseRow(Row.TOTAL_TIME, "total", total_ns, "sum of stage spans"),
        PhaseRow(
            Row.ACTUAL_TOTAL_TIME, "total", actual_ns, "process creation -> READY", _root_eta(roots), notes=root_notes
        ),
    ]
    if floor is not None:
        totals.append(floor.row(actual_ns))
    trace_hex = format_trace_id(group[0].context.trace_id) if group[0].context is not None else None
    return PhaseTable(
        rows=tuple(_display_order(rows, aggregates) + derived + totals),
        versions=dict(versions) if versions is not None else current_versions(),
        trace_id=trace_hex,
    )


def with_rank_spread(
    table: PhaseTable, per_rank: Mapping[int, PhaseTable], arrivals: Mapping[int, int] | None = None, barrier: str = ""
) -> PhaseTable:
    """Rank 0's table with, on each row that several ranks ran, the slowest rank and the spread across ranks
    (slowest - fastest), and on actual_total_time the rank that held READY back: the last to arrive at `barrier`,
    the first stage every rank waits in for all the others (`arrivals`: rank -> wall ns it began that stage)."""
    from dataclasses import replace

    rows = []
    for row in table.rows:
        seconds = {r: t[row.name].seconds for r, t in per_rank.items() if row.name in {x.name for x in t.rows}}
        ran = {r: v for r, v in seconds.items() if v is not None}
        if len(ran) < 2 or row.kind != "leaf" or row.name == Row.UNATTRIBUTED:
            rows.append(row)
            continue
        slow = max(ran, key=lambda r: (ran[r], -r))
        spread = ran[slow] - min(ran.values())
        note = f"slowest rank {slow} ({ran[slow]:.3f} s), spread {spread:.3f} s over {len(ran)} ranks"
        attrs = {
            Attr.TP_SLOWEST_RANK: slow,
            Attr.TP_SPREAD_S: round(spread, 6),
            Attr.TP_RANK_SECONDS: [round(ran[r], 6) for r in sorted(ran)],
        }
        rows.append(replace(row, notes=(*row.notes, note), attributes={**row.attributes, **attrs}))
    out = replace(table, rows=tuple(rows))
    if arrivals and len(arrivals) > 1:
        last = max(arrivals, key=lambda r: (arrivals[r], -r))
        lag = (arrivals[last] - min(arrivals.values())) / 1e9
        out = with_row_note(
            out,
            Row.ACTUAL_TOTAL_TIME,
            f"rank {last} held READY back: it reached {barrier} {lag:.3f} s after the first rank",
            {Attr.TP_HELD_BACK_RANK: last, Attr.TP_HELD_BACK_S: round(lag, 6)},
        )
    return out


def with_row_note(table: PhaseTable, name: str, note: str, attributes: Mapping[str, Any] | None = None) -> PhaseTable:
    """The table with one more note (and attributes) on row `name`, e.g. the import costs on `imports`."""
    from dataclasses import replace

    rows = tuple(
        replace(r, notes=(*r.notes, note), attributes={**r.attributes, **(attributes or {})}) if r.name == name else r
        for r in table.rows
    )
    return replace(table, rows=rows)


def _union_ns(intervals: Sequence[tuple[int, int]]) -> int:
    """The length of the union of [start, end) intervals."""
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered


def _critical_path(phases: Sequence[SpanPhase]) -> tuple[int, list[str]]:
    """The chain of stages (through `glowplug.waits_for`) with the largest sum of own times, and that sum. A span
    without the attribute (a table built from older spans) waits for the stage before it."""
    by_stage = {p.stage: p for p in phases}
    best: dict[str, tuple[int, list[str]]] = {}
    previous: str | None = None
    for phase in sorted(phases, key=lambda p: p.start_ns):
        waits = phase.attributes.get(Attr.WAITS_FOR)
        parents = [str(w) for w in waits] if waits is not None else ([previous] if previous else [])
        before = max((best[w] for w in parents if w in best and w in by_stage), default=(0, []), key=lambda b: b[0])
        best[phase.stage] = (before[0] + phase.nanos, [*before[1], phase.stage])
        previous = phase.stage
    return max(best.values(), default=(0, []), key=lambda b: b[0])


@dataclass(frozen=True)
class Floor:
    """The least a start of this config can take: read the bytes it must read or map once (the model's files and
    the cache entries it loads, `source` says) at the measured bandwidth, and import torch (measured in this
    process). Everything else the start-up does is above the floor."""

    weights_bytes: int  # the bytes to read or map (the name is the report's attribute key's)
    read_gbps: float
    import_torch_s: float
    source: str = "weights"

    @property
    def nanos(self) -> int:
        return round((self.weights_bytes / (self.read_gbps * 1e9) + self.import_torch_s) * 1e9)

    def row(self, actual_ns: int) -> PhaseRow:
        ratio = actual_ns / self.nanos if self.nanos > 0 else float("inf")
        note = (
            f"read {self.weights_bytes / 1e9:.3f} GB ({self.source}) / {self.read_gbps:.1f} GB/s read probe + "
            f"import torch {self.import_torch_s:.3f} s; actual/floor = {ratio:.2f}x"
        )
        attrs = {
            Attr.FLOOR_WEIGHTS_BYTES: self.weights_bytes,
            Attr.FLOOR_READ_GBPS: self.read_gbps,
            Attr.FLOOR_IMPORT_TORCH_S: self.import_torch_s,
            Row.ACTUAL_OVER_FLOOR: round(ratio, 3),
            Attr.FLOOR_BYTES_SOURCE: self.source,
        }
        return PhaseRow(Row.FLOOR, "floor", self.nanos, note, attrs)


def _display_order(leaves: list[PhaseRow], aggregates: list[PhaseRow]) -> list[PhaseRow]:
    # Each aggregate goes right after its last component, so the table reads top to bottom like the start-up.
    out: list[PhaseRow] = []
    for leaf in leaves:
        out.append(leaf)
        out.extend(a for a in aggregates if a.components and a.components[-1] == leaf.name)
    return out


# ---------------------------------------------------------------- rendering


def _fmt(seconds: float | None, digits: int = 3) -> str:
    return "--" if seconds is None else f"{seconds:.{digits}f}"


def _share(table: PhaseTable, row: PhaseRow) -> str:
    actual = table.actual_total_time
    if row.seconds is None or actual <= 0 or row.kind in ("total", "floor"):
        return ""
    return f"{100.0 * row.seconds / actual:.1f}%"


def _note(row: PhaseRow) -> str:
    if row.kind == "aggregate":
        formula = "= " + " + ".join(row.components)
        return f"{formula} ({row.reason})" if row.reason else formula
    return "; ".join([row.reason] * bool(row.reason) + list(row.notes))


@dataclass(frozen=True)
class DisplayRow:
    """The text of one table row exactly as every renderer prints it (the CLI, Markdown, the start-up page)."""

    name: str
    label: str  # `Σ name` for aggregates
    kind: Kind
    seconds: str
    share: str
    note: str


def display_rows(table: PhaseTable) -> list[DisplayRow]:
    return [
        DisplayRow(
            name=row.name,
            label=f"Σ {row.name}" if row.kind == "aggregate" else row.name,
            kind=row.kind,
            seconds=_fmt(row.seconds),
            share=_share(table, row),
            note=_note(row),
        )
        for row in table.rows
    ]


def to_rich(table: PhaseTable, *, wide: bool = False) -> Table:
    """A rich Table: leaves plain, aggregates bold cyan, unattributed yellow, totals bold under a rule.

    It fits 80 columns: a row name is never broken (its column is as wide as the longest name and does not wrap;
    only a terminal too narrow for the names and numbers truncates them, with an ellipsis), and the notes wrap at
    word boundaries in the space that is left. `wide`: every note on one line (print it on a wide console)."""
    rows = display_rows(table)
    # No vertical rules or outer padding: at 80 columns the notes need the room more than the table needs lines.
    out = Table(
        title="glowplug start-up phases",
        caption=_versions_line(table),
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    name_width = max((len(r.label) for r in rows), default=5)
    out.add_column("phase", no_wrap=True, min_width=name_width)
    out.add_column("seconds", justify="right", no_wrap=True)
    out.add_column("% actual", justify="right", no_wrap=True)
    # At least as wide as the longest row name, so a name quoted in a note (an aggregate's formula) never folds.
    out.add_column("note", no_wrap=wide, overflow="ignore" if wide else "fold", min_width=name_width)
    for i, row in enumerate(rows):
        style = {"aggregate": "bold cyan", "derived": "magenta", "total": "bold", "floor": "green"}.get(row.kind, "")
        if row.name == Row.UNATTRIBUTED:
            style = "yellow"
        last_before_totals = (
            row.kind not in ("total", "floor")
            and i + 1 < len(rows)
            and rows[i + 1].kind in ("total", "derived")
            and row.kind != rows[i + 1].kind
        )
        out.add_row(row.label, row.seconds, row.share, row.note, style=style, end_section=last_before_totals)
    return out


def _versions_line(table: PhaseTable) -> str:
    parts = [f"{k} {v}" for k, v in table.versions.items()]
    if table.trace_id:
        parts.append(f"trace {table.trace_id}")
    return ", ".join(parts)


def to_markdown(table: PhaseTable) -> str:
    lines = ["| phase | kind | seconds | % of actual | note |", "|:--|:--|--:|--:|:--|"]
    for row in display_rows(table):
        name = f"**{row.name}**" if row.kind not in ("leaf", "derived") else row.name
        note = row.note.replace("|", "\\|")
        lines.append(f"| {name} | {row.kind} | {row.seconds} | {row.share} | {note} |")
    lines += ["", f"_{_versions_line(table)}_", ""]
    return "\n".join(lines)


CSV_FIELDS = ("phase", "kind", "seconds", "reason")


def to_csv(table: PhaseTable) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_FIELDS)
    for row in table.rows:
        writer.writerow([row.name, row.kind, "" if row.seconds is None else f"{row.seconds:.9f}", row.reason or ""])
    return buf.getvalue()


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def to_dict(table: PhaseTable) -> dict[str, Any]:
    return {
        "schema": table.schema,
        "trace_id": table.trace_id,
        "phases": {r.name: r.seconds for r in table.rows},
        "actual_total_time": table.actual_total_time,
        "kinds": {r.name: r.kind for r in table.rows},
        "components": {r.name: list(r.components) for r in table.rows if r.components},
        "reasons": {r.name: r.reason for r in table.rows if r.reason},
        "notes": {r.name: list(r.notes) for r in table.rows if r.notes},
        "attributes": {r.name: {k: _jsonable(v) for k, v in r.attributes.items()} for r in table.rows if r.attributes},
        "versions": dict(table.versions),
    }


def to_json(table: PhaseTable) -> str:
    return json.dumps(to_dict(table), indent=2) + "\n"


def from_dict(data: Mapping[str, Any]) -> PhaseTable:
    """Inverse of `to_dict` (seconds come back to the nanosecond)."""
    rows = []
    for name, seconds in data["phases"].items():
        rows.append(
            PhaseRow(
                name=name,
                kind=data["kinds"][name],
                nanos=None if seconds is None else round(seconds * 1e9),
                reason=data.get("reasons", {}).get(name),
                attributes=data.get("attributes", {}).get(name, {}),
                components=tuple(data.get("components", {}).get(name, ())),
                notes=tuple(data.get("notes", {}).get(name, ())),
            )
        )
    return PhaseTable(
        rows=tuple(rows), versions=data.get("versions", {}), trace_id=data.get("trace_id"), schema=data["schema"]
    )


def from_csv(text: str) -> PhaseTable:
    """Inverse of `to_csv` (µs-exact; CSV carries no versions, attributes or trace id)."""
    rows = []
    for rec in csv.DictReader(io.StringIO(text)):
        nanos = None if rec["seconds"] == "" else round(float(rec["seconds"]) * 1e9)
        components = AGGREGATE_ROWS.get(rec["phase"], ()) if rec["kind"] == "aggregate" else ()
        rows.append(PhaseRow(rec["phase"], rec["kind"], nanos, rec["reason"] or None, {}, components))  # type: ignore[arg-type]
    return PhaseTable(rows=tuple(rows), versions={})


def _renderer(path: Path) -> Callable[[PhaseTable], str]:
    suffix = path.suffix.lower()
    renderers: dict[str, Callable[[PhaseTable], str]] = {".md": to_markdown, ".csv": to_csv, ".json": to_json}
    if suffix not in renderers:
        raise ValueError(f"cannot write a phase table to {path.name!r}: use one of {', '.join(REPORT_SUFFIXES)}")
    return renderers[suffix]


def write_report(table: PhaseTable, path: str | Path) -> Path:
    """Write the table as Markdown, CSV or JSON, chosen by the file suffix."""
    path = Path(path)
    text = _renderer(path)(table)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def read_report(path: str | Path) -> PhaseTable:
    """Read back a `.json` or `.csv` report (Markdown is for people)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        return from_dict(json.loads(text))
    if path.suffix.lower() == ".csv":
        return from_csv(text)
    raise ValueError(f"cannot read a phase table from {path.name!r}: use .json or .csv")
