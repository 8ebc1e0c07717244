"""The start-up ETA from the cache a start will meet: which entries will hit (the hit/miss pattern), the record of
earlier starts with their patterns, and the choice of which record predicts which phase.

Why a pattern: a start's time is mostly decided by its cache misses (a cold compile is tens of seconds, its warm
load tens of milliseconds), so the last start of the same config predicts this one only when the same entries hit.
Before the first stage, each stage that owns a cache's factors answers `cache_probe(ctx)` (the store's `probe`:
manifests and file sizes, nothing loaded); the answers make the pattern. Every start records its per-stage seconds
with its pattern in the start-up profile entry, keeping the latest start per pattern.

The choice (`predict`), first that applies:
1. the last start of this config with the same pattern: every phase from it;
2. phase by phase, the latest start (this config first, then another config of the same model) whose pattern
   agrees on the caches that phase depends on (`caches` of the stage; a stage without caches takes the latest);
3. a phase no start agrees on stays unknown: not counted, and the basis says so (the ETA is then a lower bound).
A record written before patterns were recorded has an unknown pattern: it serves only phases without caches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

HIT = "hit"
MISS = "miss"
UNKNOWN = "unknown"
KEEP_RECORDS = 8  # one per pattern a config meets (cold, warm, a few partial ones); older patterns drop off

Pattern = Mapping[str, str]


class CacheProbe(Protocol):
    """A stage that owns the factors of the caches in `caches`: `cache_probe` says which will hit for `ctx`
    (a plain EngineContext with the inputs set, filled in by the earlier stages' probes) and may set the slots its
    own `provides` names when they are cheap to know (model_prepare: the folder, the architecture, the dtype)."""

    name: str
    caches: tuple[str, ...]

    def cache_probe(self, ctx: Any) -> dict[str, str]: ...


def stage_caches(stages: Sequence[Any]) -> dict[str, tuple[str, ...]]:
    """stage name -> the caches whose hit or miss changes its time (`caches`, () for none), in pipeline order."""
    return {s.name: tuple(getattr(s, "caches", ())) for s in stages}


def pattern_text(pattern: Pattern) -> str:
    """`compile=miss, model=hit` (sorted), for span attributes and logs."""
    return ", ".join(f"{k}={v}" for k, v in sorted(pattern.items()))


def start_kind(pattern: Pattern) -> str:
    """"warm" (every probed cache hits), "cold" (none does), "partly warm" (some do), or "" (no cache involved)."""
    states = [v for v in pattern.values() if v != UNKNOWN]
    if not states:
        return ""
    if all(v == HIT for v in states):
        return "warm"
    return "cold" if all(v == MISS for v in states) else "partly warm"


@dataclass(frozen=True)
class StartRecord:
    """One recorded start: seconds per stage, its pattern (None: recorded before patterns were) and the wall time
    its stages covered (None in old records), which is less than their sum when stages ran at once."""

    stages: dict[str, float]
    pattern: dict[str, str] | None = None
    wall_s: float | None = None

    @property
    def scale(self) -> float:
        """wall / sum of the stages: what the sum of the predicted phases is multiplied by to give wall time."""
        total = sum(self.stages.values())
        if self.wall_s is None or total <= 0:
            return 1.0
        return min(1.0, max(0.05, self.wall_s / total))

    def to_json(self) -> dict[str, Any]:
        return {"stages": self.stages, "pattern": self.pattern, "wall_s": self.wall_s}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StartRecord:
        pattern = data.get("pattern")
        wall = data.get("wall_s")
        return cls({str(k): float(v) for k, v in data["stages"].items()},
                   {str(k): str(v) for k, v in pattern.items()} if isinstance(pattern, Mapping) else None,
                   float(wall) if wall is not None else None)  # fmt: skip


def parse_profile(data: Mapping[str, Any]) -> list[StartRecord]:
    """The records of a start-up profile entry, newest first. An entry from before patterns (`{"stages": ...}`
    only) is one record with an unknown pattern."""
    records = data.get("records")
    if isinstance(records, list):
        out = []
        for rec in records:
            try:
                out.append(StartRecord.from_json(rec))
            except (KeyError, TypeError, ValueError, AttributeError):
                continue  # one unreadable record costs only itself
        return out
    return [StartRecord({str(k): float(v) for k, v in data["stages"].items()})]


def profile_json(new: StartRecord, older: Sequence[StartRecord]) -> dict[str, Any]:
    """The entry's content after a start: `stages` (the latest, as older readers expect) and `records`, the latest
    start per pattern, newest first."""
    kept = [new, *(r for r in older if r.pattern != new.pattern)][:KEEP_RECORDS]
    return {"stages": new.stages, "pattern": new.pattern, "records": [r.to_json() for r in kept]}


@dataclass(frozen=True)
class PhaseEstimate:
    """Seconds per stage to expect, and where they come from.

    same_config: every phase came from a start of this config (else some from another config of the model).
    basis: the words the progress line, the page and /startup show ("from the last warm start of this config").
    kind: "same_pattern" (rule 1 of the module docstring) or "per_phase" (rule 2).
    unknown: stages no recorded start could predict (not counted: the total is then a lower bound).
    scale: wall / sum of the stages in the record the longest phase came from (stages run at once).
    """

    seconds: dict[str, float]
    same_config: bool
    basis: str = "from the last start of this config"
    kind: str = "same_pattern"
    unknown: tuple[str, ...] = ()
    scale: float = 1.0
    pattern: dict[str, str] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        """Predicted wall time of the stages: the sum, less what ran at once, but not below the longest stage."""
        if not self.seconds:
            return 0.0
        return max(sum(self.seconds.values()) * self.scale, max(self.seconds.values()))


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


def predict(pattern: Pattern, caches: Mapping[str, tuple[str, ...]], mine: Sequence[StartRecord],
            others: Sequence[StartRecord]) -> PhaseEstimate | None:  # fmt: skip
    """The estimate for a start with `pattern` of a pipeline whose stages depend on `caches` (stage_caches),
    from this config's records (`mine`) and another config's of the same model (`others`), both newest first.
    None when no start of this model was recorded."""
    if not mine and not others:
        return None
    kind = start_kind(pattern)
    if UNKNOWN not in pattern.values():
        for rec in mine:
            if rec.pattern is not None and dict(rec.pattern) == dict(pattern):
                what = f"the last {kind} start" if kind else "the last start"
                return PhaseEstimate(dict(rec.stages), True, f"from {what} of this config", "same_pattern", (),
                                     rec.scale, dict(pattern))  # fmt: skip
    candidates = [(rec, True) for rec in mine] + [(rec, False) for rec in others]
    seconds: dict[str, float] = {}
    source: dict[str, tuple[StartRecord, bool]] = {}
    for stage, deps in caches.items():
        for rec, own in candidates:
            if stage in rec.stages and _agrees(deps, pattern, rec):
                seconds[stage], source[stage] = rec.stages[stage], (rec, own)
                break
    unknown = tuple(s for s in caches if s not in seconds)
    same_config = all(own for _, own in source.values())
    where = "this config" if same_config else "this model"
    basis = f"phase by phase from earlier starts of {where} with the same cache hits and misses"
    if unknown:
        basis += f"; not counted, no start to learn from: {', '.join(unknown)}"
    scale = 1.0
    if seconds:
        longest = max(seconds, key=lambda s: seconds[s])
        scale = source[longest][0].scale
    return PhaseEstimate(seconds, same_config, basis, "per_phase", unknown, scale, dict(pattern))
