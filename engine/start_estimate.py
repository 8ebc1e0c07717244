"""The start-up ETA from the cache a start will meet: which entries will hit (the hit/miss pattern), the record of
earlier starts with their patterns, the start-up model (engine/start_model.py) for what no record covers, and the
choice of which predicts which phase.

Why a pattern: a start's time is mostly decided by its cache misses (a cold compile is tens of seconds, its warm
load tens of milliseconds), so the last start of the same config predicts this one only when the same entries hit.
Before the first stage, each stage that owns a cache's factors answers `cache_probe(ctx)` (the store's `probe`:
manifests and file sizes, nothing loaded); the answers make the pattern. The OS page cache is one more cache there
(`page_cache`: hit when it holds at least 90% of the bytes the start reads or less than 64 MiB would come from the
disk, miss under 10%, else partial), which
the stages that read the weights depend on. Every start records its per-stage seconds with its pattern, its inputs
(engine/start_inputs.py) and its pipeline's waits in the start-up profile entry, keeping the latest start per
pattern.

The choice (`predict`), first that applies:
1. the last start of this config with the same pattern: every phase from it;
2. phase by phase, the latest start (this config first, then another config of the same model) whose pattern
   agrees on the caches that phase depends on (`caches` of the stage; a stage without caches takes the latest);
3. a phase no start agrees on: the start-up model, fitted on this machine's recorded starts of any model (the
   basis names its terms and inputs). Without inputs (they could not be read) such a phase stays unknown: not
   counted, and the basis says so (the ETA is then a lower bound).
A record written before patterns were recorded has an unknown pattern: it serves only phases without caches.

The wall time of the predicted phases is their critical path through the pipeline's waits (stages run at once),
times the contention the start they come from showed (its wall time over its own critical path: two stages on two
cores are slower together than apart); a record without waits gives the older rule, the sum times wall/sum.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .start_model import PRIOR, Coefficients, Observation, fit, predict_phase
from .start_record import StartRecord, critical_path
from .start_terms import Inputs

HIT = "hit"
MISS = "miss"
PARTIAL = "partial"
UNKNOWN = "unknown"
PAGE_CACHE = "page_cache"
# The stages whose time depends on how much of what they read is in the page cache.
READS_FILES = ("load_weights", "quantize_weights")
# The stages that run the compiled step first: right after a fresh compile they pay for loading its kernels and for
# the compiler's worker processes still winding down, so their time depends on whether the compile cache hit.
RUNS_COMPILED = ("graph_capture", "warmup")
COMPILE = "compile"
RESIDENT_HIT, RESIDENT_MISS = 0.9, 0.1
# Bytes a start may read from disk and still count as a page-cache hit: a small model's files (or a few entry files
# evicted under memory pressure) cost a fraction of a second, not a different kind of start.
PAGE_CACHE_SLACK_BYTES = 64 << 20
# A running stage past its estimate is expected to need at least this share of the time it has run so far: the
# ETA then grows with the elapsed time instead of standing still at "any moment now". Why this share: a stage whose
# time spreads log-normally by about 25% around its estimate has, once past it, about 0.2 of the estimate left
# (0.24 at 1x, 0.19 at 1.3x, 0.16 at 2x); 0.15 of the elapsed time matches that from 1x to 1.5x and keeps growing.
OVERRUN_SHARE = 0.15

Pattern = Mapping[str, str]


class CacheProbe(Protocol):
    """A stage that owns the factors of the caches in `caches`: `cache_probe` says which will hit for `ctx`
    (a plain EngineContext with the inputs set, filled in by the earlier stages' probes) and may set the slots its
    own `provides` names when they are cheap to know (model_prepare: the folder, the architecture, the dtype)."""

    name: str
    caches: tuple[str, ...]

    def cache_probe(self, ctx: Any) -> dict[str, str]: ...


def stage_caches(stages: Sequence[Any]) -> dict[str, tuple[str, ...]]:
    """stage name -> the caches whose hit or miss changes its time (`caches`, () for none; the page cache for the
    stages that read the weights; the compile cache for those that run the compiled step first), in pipeline
    order."""
    return {
        s.name: tuple(getattr(s, "caches", ()))
        + ((PAGE_CACHE,) if s.name in READS_FILES else ())
        + ((COMPILE,) if s.name in RUNS_COMPILED else ())
        for s in stages
    }


def page_cache_state(read_bytes: float, resident_bytes: float | None) -> str:
    """The page cache as a cache of the pattern: hit (>= 90% of the bytes resident, or at most
    PAGE_CACHE_SLACK_BYTES to read from disk), miss (<= 10% resident), else partial."""
    if resident_bytes is None:
        return UNKNOWN
    cold = max(0.0, read_bytes - resident_bytes)
    share = resident_bytes / read_bytes if read_bytes > 0 else 1.0
    if share >= RESIDENT_HIT or cold <= PAGE_CACHE_SLACK_BYTES:
        return HIT
    return MISS if share <= RESIDENT_MISS else PARTIAL


def pattern_text(pattern: Pattern) -> str:
    """`compile=miss, model=hit` (sorted), for span attributes and logs."""
    return ", ".join(f"{k}={v}" for k, v in sorted(pattern.items()))


def start_kind(pattern: Pattern) -> str:
    """ "warm" (every probed cache hits), "cold" (none does), "partly warm" (some do), or "" (no cache involved).
    The page cache is left out: a cold start of a model whose file was just read is still a cold start."""
    states = [v for k, v in pattern.items() if v != UNKNOWN and k != PAGE_CACHE]
    if not states:
        return ""
    if all(v == HIT for v in states):
        return "warm"
    return "cold" if all(v == MISS for v in states) else "partly warm"


@dataclass(frozen=True)
class PhaseSource:
    """Where one phase's seconds come from: "recorded" (a start with the same hits for it) or "model" (its terms),
    in words, with the inputs the model used."""

    kind: str
    basis: str
    inputs: dict[str, float] = field(default_factory=dict)
    own: bool = False  # recorded by a start of this very config

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "basis": self.basis, "inputs": self.inputs}

    @property
    def qualifier(self) -> str:
        """How the progress line qualifies this phase's estimate: "" (this config's own start), "first start for
        this config" (another config's), "start-up model"."""
        return "" if self.own else "start-up model" if self.kind == "model" else "first start for this config"


@dataclass(frozen=True)
class PhaseEstimate:
    """Seconds per stage to expect, and where they come from.

    same_config: every phase came from a start of this config (else some from another config or the model).
    basis: the words the progress line, the page and /startup show ("from the last warm start of this config").
    kind: "same_pattern" (rule 1 of the module docstring), "per_phase" (rules 2 and 3) or "model" (rule 3 alone).
    unknown: stages nothing could predict (not counted: the total is then a lower bound).
    scale: wall / sum of the stages in the record the longest phase came from (stages run at once).
    sources: stage -> where its seconds come from (PhaseSource).
    deps: the pipeline's waits, for the critical path; contention: see `StartRecord.contention`.
    before_s: predicted seconds from process creation to the first stage (for a prediction made before starting).
    imports_s: predicted seconds from the main entry to the first stage (the engine's imports, then the plan): a
    server's ETA while its core imports the engine.
    tail_s: seconds from the last stage's end to READY, counted after every stage (remaining_s).
    """

    seconds: dict[str, float]
    same_config: bool
    basis: str = "from the last start of this config"
    kind: str = "same_pattern"
    unknown: tuple[str, ...] = ()
    scale: float = 1.0
    pattern: dict[str, str] = field(default_factory=dict)
    sources: dict[str, PhaseSource] = field(default_factory=dict)
    deps: dict[str, tuple[str, ...]] | None = None
    contention: float = 1.0
    before_s: float | None = None
    imports_s: float | None = None
    tail_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Predicted wall time of the stages (module docstring), never below the longest stage; then the tail to
        READY."""
        if not self.seconds:
            return 0.0
        return self.remaining_s((), {})

    def remaining_s(self, finished: Collection[str], running: Mapping[str, float]) -> float:
        """Seconds until READY (the stages, then `tail_s`), given the stages `finished` and those `running`
        (stage -> seconds elapsed). A running stage has its estimate less what it used, but never less than
        OVERRUN_SHARE of what it used: one that overruns its estimate keeps the ETA growing with the time it takes.
        A running or finished stage without an estimate counts as done when finished, and adds its overrun share
        while running."""
        rest = {s: max(self.seconds.get(s, 0.0) - e, OVERRUN_SHARE * e) for s, e in running.items()}
        left = {s: v for s, v in self.seconds.items() if s not in finished and s not in running}
        longest = max([*rest.values(), *left.values()], default=0.0)
        if self.deps is not None:
            known = {**{s: 0.0 for s in finished}, **rest}
            order = {**{s: 0.0 for s in known}, **left}
            return max(critical_path(order, self.deps, known) * self.contention, longest) + self.tail_s
        return max((sum(rest.values()) + sum(left.values())) * self.scale, longest) + self.tail_s

    def sources_json(self) -> dict[str, dict[str, Any]]:
        return {s: src.to_json() for s, src in self.sources.items()}

    def phases_json(self) -> dict[str, dict[str, Any]]:
        """stage -> {seconds, kind, basis, inputs}: each predicted phase with where it comes from (the report's
        `glowplug.eta.phases` and /startup's `eta_phases`)."""
        return {
            s: {
                "seconds": round(v, 6),
                **(src.to_json() if (src := self.sources.get(s)) is not None else {"kind": "recorded"}),
            }
            for s, v in self.seconds.items()
        }

    def qualifiers(self) -> dict[str, str]:
        """stage -> how the progress line qualifies its estimate (PhaseSource.qualifier)."""
        return {s: src.qualifier for s, src in self.sources.items()}


def _agrees(stage_deps: tuple[str, ...], pattern: Pattern, record: StartRecord) -> bool:
    if not stage_deps:
        return True
    if record.pattern is None:
        return False
    for cache in stage_deps:
        state = pattern.get(cache)  # None: this config does not use the cache (e.g. quantization none)
        if state == UNKNOWN or record.pattern.get(cache) != state:
            return False
    return True


def _record_basis(rec: StartRecord, own: bool, deps: tuple[str, ...]) -> str:
    where = "this config" if own else "another config of this model"
    kind = start_kind(rec.pattern or {})
    state = ", ".join(f"{c}={(rec.pattern or {}).get(c)}" for c in deps)
    return f"recorded: the last {kind + ' ' if kind else ''}start of {where}" + (f" with {state}" if state else "")


def observations(records: Sequence[StartRecord]) -> dict[str, list[Observation]]:
    """stage -> the recorded starts that ran it with their inputs (records without inputs or pattern say nothing
    to the model). The probe measured right after a start stands for the one it was planned with."""
    out: dict[str, list[Observation]] = {}
    for rec in records:
        if rec.inputs is None or rec.pattern is None:
            continue
        values = dict(rec.inputs)
        if rec.probe_gbps:
            values["probe_gbps"] = rec.probe_gbps
        x = Inputs(values, rec.pattern)
        for stage, seconds in rec.stages.items():
            out.setdefault(stage, []).append(Observation(x, seconds))
    return out


def fit_records(records: Sequence[StartRecord]) -> Coefficients:
    """The start-up model's coefficients from these recorded starts (this machine's, any model)."""
    used = [r for r in records if r.inputs is not None and r.pattern is not None]
    return fit(observations(used), len(used), len({r.model for r in used if r.model}))


def predict(
    pattern: Pattern,
    caches: Mapping[str, tuple[str, ...]],
    mine: Sequence[StartRecord],
    others: Sequence[StartRecord],
    *,
    inputs: Mapping[str, float] | None = None,
    coefficients: Coefficients | None = None,
    deps: Mapping[str, Sequence[str]] | None = None,
) -> PhaseEstimate | None:
    """The estimate for a start with `pattern` of a pipeline whose stages depend on `caches` (stage_caches),
    from this config's records (`mine`) and another config's of the same model (`others`), both newest first, and
    for the phases no record serves, the start-up model on `inputs` with `coefficients` (rule 3). `deps`: the
    pipeline's waits (stage_dependencies), for the wall time. None when no start of this model was recorded and
    there are no inputs for the model."""
    waits = {k: tuple(v) for k, v in deps.items()} if deps is not None else None
    if not mine and not others and inputs is None:
        return None
    kind = start_kind(pattern)
    if UNKNOWN not in pattern.values():
        for rec in mine:
            if rec.pattern is not None and dict(rec.pattern) == dict(pattern):
                what = f"the last {kind} start" if kind else "the last start"
                basis = f"from {what} of this config"
                sources: dict[str, PhaseSource] = {
                    s: PhaseSource("recorded", f"recorded: {what} of this config", own=True) for s in rec.stages
                }
                contention = rec.contention
                return PhaseEstimate(
                    dict(rec.stages),
                    True,
                    basis,
                    "same_pattern",
                    (),
                    rec.scale,
                    dict(pattern),
                    sources,
                    rec.deps if contention is not None else None,
                    contention or 1.0,
                    tail_s=rec.tail_s or 0.0,
                )
    candidates = [(rec, True) for rec in mine] + [(rec, False) for rec in others]
    seconds: dict[str, float] = {}
    sources = {}
    source: dict[str, tuple[StartRecord, bool]] = {}
    for stage, stage_deps in caches.items():
        for rec, own in candidates:
            if stage in rec.stages and _agrees(stage_deps, pattern, rec):
                seconds[stage], source[stage] = rec.stages[stage], (rec, own)
                sources[stage] = PhaseSource("recorded", _record_basis(rec, own, stage_deps), own=own)
                break
    modelled: list[str] = []
    model_basis = (coefficients or PRIOR).provenance()
    if inputs is not None:
        x = Inputs(inputs, pattern)
        for stage in caches:
            if stage not in seconds:
                phase = predict_phase(stage, x, coefficients or PRIOR)
                seconds[stage] = phase.seconds
                sources[stage] = PhaseSource("model", phase.basis, phase.inputs)
                modelled.append(stage)
    seconds = {s: seconds[s] for s in caches if s in seconds}  # pipeline order
    unknown = tuple(s for s in caches if s not in seconds)
    same_config = not modelled and all(own for _, own in source.values())
    if source and modelled:
        where = "this config" if all(own for _, own in source.values()) else "this model"
        basis = (
            f"phase by phase: {len(source)} from earlier starts of {where} with the same cache hits and "
            f"misses, {len(modelled)} ({', '.join(modelled)}) from the start-up model{model_basis}"
        )
    elif modelled:
        basis = f"start-up model{model_basis}: no start of this model with these cache hits recorded"
    else:
        where = "this config" if same_config else "this model"
        basis = f"phase by phase from earlier starts of {where} with the same cache hits and misses"
    if unknown:
        basis += f"; not counted, no start to learn from: {', '.join(unknown)}"
    scale, contention = 1.0, 1.0
    recorded = {s: v for s, v in seconds.items() if s in source}
    if recorded:
        longest_rec = source[max(recorded, key=lambda s: recorded[s])][0]
        scale = longest_rec.scale
        contention = longest_rec.contention or 1.0
    use_deps = waits if waits is not None else next((r.deps for r, _ in candidates if r.deps is not None), None)
    tail = next((r.tail_s for r, _ in candidates if r.tail_s is not None), 0.0)
    return PhaseEstimate(
        seconds,
        same_config,
        basis,
        "model" if not source else "per_phase",
        unknown,
        scale,
        dict(pattern),
        sources,
        use_deps,
        contention,
        tail_s=tail,
    )
