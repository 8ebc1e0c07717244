"""The start-up profile's records: one start's seconds per stage with its cache pattern, inputs and waits
(`StartRecord`), how the profile entry holds them (`profile_json`, `parse_profile`: the latest few starts per
pattern), read by engine/start_estimate.py and written at READY (engine/stages/ready.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The latest few starts per pattern a config meets (cold, warm, a few partial ones): rule 1 takes the newest, the
# start-up model's fit all of them; older patterns drop off.
KEEP_PER_PATTERN = 3
KEEP_RECORDS = 12


def _floats(data: Any) -> dict[str, float] | None:
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, Mapping) else None


@dataclass(frozen=True)
class StartRecord:
    """One recorded start: seconds per stage, its pattern (None: recorded before patterns were) and the wall time
    its stages covered (None in old records), which is less than their sum when stages ran at once.

    inputs: what was known before it (start_inputs), for the model's fit; deps: the pipeline's waits (stage -> the
    stages it waited for); entries: cache -> the entry key it used (a later prediction without torch checks that
    they are still there); machine: where it ran (the fit takes this machine's starts only); model: the model's
    cache group; before_s: process creation -> the first stage (None in library use); imports_s: main entry -> the
    first stage (the engine's imports, torch first, then the plan); probe_gbps: the read probe measured right
    after it; tail_s: the last stage's end -> READY (the pipeline's own work after its stages). Every field
    after `wall_s` is None in records from before they were kept.
    """

    stages: dict[str, float]
    pattern: dict[str, str] | None = None
    wall_s: float | None = None
    inputs: dict[str, float] | None = None
    deps: dict[str, tuple[str, ...]] | None = None
    entries: dict[str, str] | None = None
    machine: str | None = None
    model: str | None = None
    before_s: float | None = None
    probe_gbps: float | None = None
    imports_s: float | None = None
    tail_s: float | None = None

    @property
    def scale(self) -> float:
        """wall / sum of the stages: what the sum of the predicted phases is multiplied by to give wall time."""
        total = sum(self.stages.values())
        if self.wall_s is None or total <= 0:
            return 1.0
        return min(1.0, max(0.05, self.wall_s / total))

    @property
    def contention(self) -> float | None:
        """wall / critical path of its own stages through its waits (>= 1: stages that ran at once slowed each
        other); None without waits or wall time."""
        if self.deps is None or self.wall_s is None:
            return None
        path = critical_path(self.stages, self.deps)
        return max(1.0, self.wall_s / path) if path > 0 else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"stages": self.stages, "pattern": self.pattern, "wall_s": self.wall_s}
        extra = {
            "inputs": self.inputs,
            "deps": {k: list(v) for k, v in self.deps.items()} if self.deps else None,
            "entries": self.entries,
            "machine": self.machine,
            "model": self.model,
            "before_s": self.before_s,
            "probe_gbps": self.probe_gbps,
            "imports_s": self.imports_s,
            "tail_s": self.tail_s,
        }
        out.update({k: v for k, v in extra.items() if v is not None})
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StartRecord:
        pattern = data.get("pattern")
        wall = data.get("wall_s")
        deps = data.get("deps")
        entries = data.get("entries")
        return cls(
            {str(k): float(v) for k, v in data["stages"].items()},
            {str(k): str(v) for k, v in pattern.items()} if isinstance(pattern, Mapping) else None,
            float(wall) if wall is not None else None,
            _floats(data.get("inputs")),
            {str(k): tuple(str(d) for d in v) for k, v in deps.items()} if isinstance(deps, Mapping) else None,
            {str(k): str(v) for k, v in entries.items()} if isinstance(entries, Mapping) else None,
            str(data["machine"]) if data.get("machine") else None,
            str(data["model"]) if data.get("model") else None,
            float(data["before_s"]) if data.get("before_s") is not None else None,
            float(data["probe_gbps"]) if data.get("probe_gbps") else None,
            float(data["imports_s"]) if data.get("imports_s") is not None else None,
            float(data["tail_s"]) if data.get("tail_s") is not None else None,
        )


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
    KEEP_PER_PATTERN starts per pattern, newest first."""
    kept: list[StartRecord] = []
    for rec in [new, *older]:
        if sum(1 for k in kept if k.pattern == rec.pattern) < KEEP_PER_PATTERN:
            kept.append(rec)
    kept = kept[:KEEP_RECORDS]
    return {"stages": new.stages, "pattern": new.pattern, "records": [r.to_json() for r in kept]}


def critical_path(
    seconds: Mapping[str, float], deps: Mapping[str, Sequence[str]], done_at: Mapping[str, float] | None = None
) -> float:
    """When the last stage ends if each starts as soon as the stages it waits for have ended (from 0): stages in
    `seconds` order (the pipeline's). `done_at`: stages whose end is already known (0 for a finished one, the
    expected rest for a running one); a stage missing from `seconds` takes no time."""
    end: dict[str, float] = dict(done_at or {})
    for stage, took in seconds.items():
        if stage in end:
            continue
        end[stage] = max((end.get(d, 0.0) for d in deps.get(stage, ())), default=0.0) + took
    return max(end.values(), default=0.0)
