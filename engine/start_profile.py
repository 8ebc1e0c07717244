"""The start-up profile as the ETA reads it, without importing torch: this config's recorded starts, every recorded
start on this machine (what the start-up model is fitted on), and a plan made from the store alone for
`glowplug startup --predict-only`.

A live start plans in engine/startup.py (`plan_start`), after its imports, with every stage's cache probe; a
prediction made before starting cannot run the probes (they compute their keys with torch) and reads the cache
states from the store instead (`predicted_pattern`): an entry a recorded start of this config used is a hit while
it is still there with its recorded sizes, and a cache no start of this model ever filled is a miss. The compile
cache, whose key changes with the glowplug source and torch, is told by comparing the factors known before a start
with its stored entries' (engine/compile_index.py); the basis is one of the plan's notes.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import STARTUP_PROFILE, by_name

from .compile_index import forecast
from .config import EngineConfig
from .models.store import model_group
from .start_estimate import (
    COMPILE,
    HIT,
    MISS,
    PAGE_CACHE,
    UNKNOWN,
    PhaseEstimate,
    fit_records,
    page_cache_state,
    predict,
)
from .start_inputs import StartInputs, gather_inputs
from .start_record import StartRecord, parse_profile

PHASES = "phases.json"
# The stages of the default pipeline in order, for a prediction on a machine that recorded no start yet.
DEFAULT_PIPELINE = (
    "model_prepare",
    "tokenizer_init",
    "grammar_init",
    "load_weights",
    "quantize_weights",
    "model_init",
    "native_kernels",
    "dynamo_transform",
    "graph_compile",
    "kv_cache_profiling",
    "kv_cache_init",
    "graph_capture",
    "warmup",
)
# The caches each of those stages depends on (their `caches`, and the page cache for the weight readers).
DEFAULT_CACHES: dict[str, tuple[str, ...]] = {
    "model_prepare": ("model",),
    "load_weights": (PAGE_CACHE,),
    "quantize_weights": ("quant", PAGE_CACHE),
    "native_kernels": ("native",),
    "dynamo_transform": ("compile",),
    "graph_compile": ("compile",),
    "kv_cache_profiling": ("kv_profile",),
    # start_estimate.RUNS_COMPILED: their first run of the compiled step costs more right after a fresh compile.
    "graph_capture": ("compile",),
    "warmup": ("compile",),
}
# Caches whose entries belong to one model (the others, such as the native kernels, serve every model).
PER_MODEL = ("model", "quant", "compile", "kv_profile")


def this_machine() -> str:
    """What the start-up model's fit is per: the CPU's model name and its core count."""
    from glowplug.base.machine import cpu_model

    return f"{cpu_model()} x{os.cpu_count() or 1}"


def profile_factors(config: EngineConfig, device: str) -> dict[str, Any]:
    """The start-up profile's key factors. The model as a name, not the spec that named it: the default, its file
    by path and a bundle's copy of it are one model, so a start from a bundle finds the profile the bundle
    brought."""
    tp: dict[str, Any] = {}
    if config.tensor_parallel_size > 1:
        from .parallel import tp_factors

        tp = tp_factors(config.tensor_parallel_size)
    return {"engine_config": {**config.hash_factors(), "model": model_group(config.model)}, "device": device, **tp}


def read_records(folder: Path) -> list[StartRecord]:
    return parse_profile(json.loads((folder / PHASES).read_text()))


def lookup_records(store: ArtifactStore, config: EngineConfig) -> list[StartRecord]:
    """This config's recorded starts, newest first (empty when none or unreadable); a damaged entry is reported as
    the store's lookup reports one."""
    factors = profile_factors(config, config.resolved_device())
    return store.lookup(STARTUP_PROFILE, factors, group=model_group(config.model), load=read_records).value or []


def config_records(store: ArtifactStore, config: EngineConfig, device: str) -> list[StartRecord]:
    """This config's recorded starts, newest first, read without moving or stamping anything (empty when none or
    unreadable; a start's own lookup deals with a damaged entry)."""
    path = store.entry_path(STARTUP_PROFILE, store.key(STARTUP_PROFILE, profile_factors(config, device)))
    try:
        return read_records(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


@dataclass(frozen=True)
class ProfileEntry:
    """One config's recorded starts, with the model (cache group) and the entry key they are filed under."""

    key: str
    group: str
    records: list[StartRecord]
    used: float  # the entry's last use (manifest mtime), for newest-first order


def profile_entries(store: ArtifactStore) -> list[ProfileEntry]:
    """Every config's recorded starts in this cache dir, the most recently used first."""
    out: list[ProfileEntry] = []
    for entry, m, used in store.entries(STARTUP_PROFILE):
        try:
            out.append(ProfileEntry(entry.name, m.group, read_records(entry), used))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def machine_records(entries: Sequence[ProfileEntry], machine: str | None = None) -> list[StartRecord]:
    """The recorded starts of this machine (any model, any config) that the model can learn from, newest entry
    first. A record without a machine (recorded before machines were) is left out: it may come from a bundle."""
    machine = machine or this_machine()
    return [r for e in entries for r in e.records if r.machine == machine and r.inputs is not None]


def latest_probe(records: Sequence[StartRecord]) -> float | None:
    """The median of the last three read probes recorded on this machine (a busy moment's probe alone misleads)."""
    probes = [r.probe_gbps for r in records if r.probe_gbps][:3]
    return statistics.median(probes) if probes else None


@dataclass(frozen=True)
class StartPlan:
    """What is known before the first stage: which caches will hit (the pattern), the estimate made from it (None
    when nothing could be predicted), the inputs and waits it used, and what the start records with its times."""

    pattern: dict[str, str]
    estimate: PhaseEstimate | None
    inputs: StartInputs | None = None
    deps: dict[str, tuple[str, ...]] | None = None
    entries: dict[str, str] = field(default_factory=dict)  # cache -> the entry key its probe looked for
    machine: str = ""
    notes: tuple[str, ...] = ()  # what the plan could not read (the inputs' notes, a probe that failed)

    @property
    def basis(self) -> str:
        """The ETA's basis in words, for every place that shows the ETA."""
        if self.estimate is None:
            return "first start of this model: no estimate yet"
        return self.estimate.basis


def estimate_for(
    config: EngineConfig,
    store: ArtifactStore,
    device: str,
    pattern: dict[str, str],
    caches: dict[str, tuple[str, ...]],
    deps: dict[str, tuple[str, ...]] | None,
    inputs: StartInputs | None,
    entries: Sequence[ProfileEntry],
) -> PhaseEstimate | None:
    """The estimate (start_estimate.predict) from this config's records, the latest other config's of the same
    model, and the model fitted on this machine's records."""
    mine = config_records(store, config, device)
    own_key = store.key(STARTUP_PROFILE, profile_factors(config, device))
    group = model_group(config.model)
    others = next((e.records for e in entries if e.group == group and e.key != own_key), [])
    learned = machine_records(entries)
    coefficients = fit_records(learned)
    return predict(
        pattern,
        caches,
        mine,
        others,
        inputs=inputs.values if inputs is not None else None,
        coefficients=coefficients,
        deps=deps,
    )


def with_page_cache(pattern: dict[str, str], inputs: StartInputs | None) -> dict[str, str]:
    """The pattern with the page cache's state (from the inputs' residency), when the inputs say it."""
    if inputs is None:
        return pattern
    return {**pattern, PAGE_CACHE: page_cache_state(inputs.get("read_bytes"), inputs.values.get("resident_bytes"))}


# ---------------------------------------------------------------- a prediction before starting


def _device(config: EngineConfig) -> str:
    from .config_check import preflight_device

    device = preflight_device(config)
    return config.resolved_device() if device == "unknown" else device


def predicted_pattern(
    config: EngineConfig, store: ArtifactStore, device: str, entries: Sequence[ProfileEntry]
) -> tuple[dict[str, str], dict[str, Path], list[str]]:
    """The cache states a start of `config` would meet, read from the store alone (module docstring), the entry
    folders it would read, and how each state was told."""
    group = model_group(config.model)
    mine = config_records(store, config, device)
    template = next((r for r in mine if r.pattern is not None), None)
    how: list[str] = []
    if template is None:
        template = next((r for e in entries if e.group == group for r in e.records if r.pattern is not None), None)
    if template is None:
        template = next((r for e in entries for r in e.records if r.pattern is not None), None)
    caches = [c for c in (template.pattern or {}) if c != PAGE_CACHE] if template is not None else ["model"]
    if config.compile_enabled() and COMPILE not in caches:
        caches.append(COMPILE)
    pattern: dict[str, str] = {}
    found: dict[str, Path] = {}
    for cache in caches:
        if cache == COMPILE:
            if not config.compile_enabled():
                continue
            told = forecast(config, store, device)
            pattern[cache] = told.state
            if told.entry is not None:
                found[cache] = told.entry
            how.append(told.basis)
            continue
        spec = by_name(cache)
        key = next((r.entries[cache] for r in mine if r.entries and cache in r.entries), None)
        if key is not None:
            there = store.present(spec, key)
            pattern[cache] = HIT if there else MISS
            if there:
                found[cache] = store.entry_path(spec, key)
            continue
        if cache in PER_MODEL and store.latest(spec, group) is None:
            pattern[cache] = MISS
        elif cache in PER_MODEL:
            pattern[cache] = UNKNOWN
            how.append(
                f"{cache}: an entry of this model exists, but no start of this config used it: predicted as a miss"
            )
        else:
            # A cache every model shares (the native kernels): any entry there serves this start too.
            folder = store.folder(spec)
            filled = folder.is_dir() and any(not p.name.startswith(".") for p in folder.iterdir())
            pattern[cache] = HIT if filled else MISS
    return pattern, found, how


def predict_before_start(config: EngineConfig, cache_root: Path) -> StartPlan:
    """The plan of a start of `config` made without starting it: no torch, no weight read (module docstring).
    `estimate.before_s` is the predicted time from process creation to the first stage (the median of this
    machine's recorded starts), so before_s + total_s is the predicted time to READY."""
    store = ArtifactStore(cache_root)
    device = _device(config)
    entries = profile_entries(store)
    pattern, found, how = predicted_pattern(config, store, device, entries)
    learned = machine_records(entries)
    notes = list(how)
    try:
        inputs: StartInputs | None = gather_inputs(config, entries=found, probe_gbps=latest_probe(learned))
        notes += inputs.notes if inputs is not None else []
    except ValueError as exc:
        inputs = None
        notes.append(str(exc))
    pattern = with_page_cache(pattern, inputs)
    template = next((r for r in learned if r.deps), None)
    stages = list(template.stages) if template is not None else list(DEFAULT_PIPELINE)
    if config.tensor_parallel_size > 1 and "distributed_init" not in stages:
        stages.insert(0, "distributed_init")
    caches = {s: DEFAULT_CACHES.get(s, ()) for s in stages}
    deps = template.deps if template is not None else None
    estimate = estimate_for(config, store, device, pattern, caches, deps, inputs, entries)
    if estimate is not None:
        from dataclasses import replace

        befores = [r.before_s for r in learned if r.before_s is not None][:5]
        imports = [r.imports_s for r in learned if r.imports_s is not None][:5]
        estimate = replace(
            estimate,
            before_s=statistics.median(befores) if befores else None,
            imports_s=statistics.median(imports) if imports else None,
        )
    return StartPlan(
        pattern, estimate, inputs, deps, {c: p.name for c, p in found.items()}, this_machine(), tuple(notes)
    )
