"""The start-up ETA that knows the cache (issue 35): the hit/miss pattern probed before the first stage, the choice
of the recorded start that predicts each phase, and, with real processes, cold -> warm -> warm -> emptied -> cold,
each start's first ETA coming from the start with the same cache hits and misses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import CacheSpec
from glowplug.engine.models.store import model_group
from glowplug.engine.start_estimate import HIT, MISS, UNKNOWN, predict, start_kind
from glowplug.engine.start_record import StartRecord, parse_profile, profile_json
from glowplug.profiling.names import Attr

CACHES = {
    "model_prepare": ("model",),
    "load_weights": (),
    "graph_compile": ("compile",),
    "kv_cache_profiling": ("kv_profile",),
}
COLD = {"model": MISS, "compile": MISS, "kv_profile": MISS}
WARM = {"model": HIT, "compile": HIT, "kv_profile": HIT}
COLD_TIMES = {"model_prepare": 1.0, "load_weights": 0.5, "graph_compile": 20.0, "kv_cache_profiling": 10.0}
WARM_TIMES = {"model_prepare": 0.01, "load_weights": 0.4, "graph_compile": 0.03, "kv_cache_profiling": 0.01}


# ---------------------------------------------------------------- the choice (pure)


def test_same_pattern_of_this_config_wins_over_a_newer_start_with_other_hits() -> None:
    cold = StartRecord(COLD_TIMES, COLD, wall_s=21.5)
    warm = StartRecord(WARM_TIMES, WARM, wall_s=0.45)
    est = predict(COLD, CACHES, [warm, cold], [])
    assert est is not None and est.kind == "same_pattern" and est.same_config
    assert est.seconds == COLD_TIMES and est.basis == "from the last cold start of this config"
    assert est.total_s == pytest.approx(21.5)  # the stages' wall time, not their sum (31.5): some ran at once
    warm_est = predict(WARM, CACHES, [warm, cold], [])
    assert warm_est is not None and warm_est.basis == "from the last warm start of this config"
    assert warm_est.seconds == WARM_TIMES


def test_phase_by_phase_from_starts_whose_hits_agree_and_unknown_is_not_counted() -> None:
    # compile hits, the KV profile misses (a new max_num_batched_tokens): no start had exactly that.
    mixed = {"model": HIT, "compile": HIT, "kv_profile": MISS}
    cold = StartRecord(COLD_TIMES, COLD)
    warm = StartRecord(WARM_TIMES, WARM)
    est = predict(mixed, CACHES, [warm, cold], [])
    assert est is not None and est.kind == "per_phase" and est.same_config
    assert est.seconds == {
        "model_prepare": 0.01,
        "load_weights": 0.4,
        "graph_compile": 0.03,
        "kv_cache_profiling": 10.0,
    }
    assert est.unknown == () and "phase by phase" in est.basis
    # Only a cold start recorded: the hits have no start to learn from, so they are left out and said so.
    only_cold = predict(WARM, CACHES, [cold], [])
    assert only_cold is not None and set(only_cold.seconds) == {"load_weights"}
    assert set(only_cold.unknown) == {"model_prepare", "graph_compile", "kv_cache_profiling"}
    assert "not counted" in only_cold.basis and "graph_compile" in only_cold.basis


def test_another_config_serves_phases_whose_hits_agree_and_says_so() -> None:
    est = predict(WARM, CACHES, [], [StartRecord(WARM_TIMES, WARM)])
    assert est is not None and not est.same_config and est.kind == "per_phase"
    assert est.seconds == WARM_TIMES and "this model" in est.basis
    assert predict(WARM, CACHES, [], []) is None  # nothing recorded: no estimate


def test_an_unknown_state_or_an_old_record_never_passes_for_a_match() -> None:
    legacy = parse_profile({"stages": COLD_TIMES})  # written before patterns were recorded
    assert legacy == [StartRecord(COLD_TIMES, None, None)]
    est = predict(WARM, CACHES, legacy, [])
    assert est is not None and set(est.seconds) == {"load_weights"}  # the only phase without a cache
    unsure = {"model": HIT, "compile": UNKNOWN, "kv_profile": HIT}
    est = predict(unsure, CACHES, [StartRecord(WARM_TIMES, dict(unsure))], [])
    assert est is not None and est.kind == "per_phase" and "graph_compile" in est.unknown


def test_profile_keeps_the_latest_start_per_pattern_and_reads_back() -> None:
    cold = StartRecord(COLD_TIMES, COLD, 21.5)
    warm1, warm2 = StartRecord(WARM_TIMES, WARM, 0.5), StartRecord({**WARM_TIMES, "load_weights": 0.3}, WARM, 0.4)
    data = profile_json(warm2, [warm1, cold])
    assert data["stages"] == warm2.stages  # what readers of the old format take
    # The latest few per pattern (rule 1 takes the newest; the start-up model learns from all of them).
    assert parse_profile(json.loads(json.dumps(data))) == [warm2, warm1, cold]
    assert start_kind(COLD) == "cold" and start_kind(WARM) == "warm" and start_kind({}) == ""
    assert start_kind({"model": HIT, "compile": MISS}) == "partly warm"


# ---------------------------------------------------------------- the lookup (no processes)


def test_store_probe_answers_without_loading_or_moving_anything(tmp_path: Path) -> None:
    spec = CacheSpec("probe_test", 1, "test entries", "bypass", "nothing")
    store = ArtifactStore(tmp_path)
    assert not store.probe(spec, {"a": 1})

    def build(folder: Path | None) -> None:
        assert folder is not None
        (folder / "data.bin").write_bytes(b"x" * 100)

    store.put(spec, {"a": 1}, group="m", build=build)
    assert store.probe(spec, {"a": 1}) and not store.probe(spec, {"a": 2})
    entry = store.entry_path(spec, store.key(spec, {"a": 1}))
    (entry / "data.bin").write_bytes(b"x" * 10)  # truncated: a fetch would miss (and move it aside)
    assert not store.probe(spec, {"a": 1})
    assert entry.is_dir()  # the probe moved nothing


def test_pattern_of_a_start_before_and_after_it_ran(tiny_dir, tmp_path: Path) -> None:
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.startup import build_engine, plan_start, probe_cache_pattern

    cache = tmp_path / "cache"
    config = EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off", kv_profile="measure")
    # A local folder is no model cache entry, --compile off uses neither the native nor the compile cache, and the
    # analytic KV peak no cache at all (hence a measured one here).
    assert probe_cache_pattern(config, cache) == {"kv_profile": MISS}
    first = plan_start(config, cache)
    # Nothing recorded: every phase from the start-up model's shipped prior, on the inputs read before the start.
    assert first.estimate is not None and first.estimate.kind == "model" and not first.estimate.unknown
    assert first.inputs is not None and first.inputs.get("read_bytes") > 0
    assert first.pattern == {"kv_profile": MISS, "page_cache": HIT}  # the checkpoint was just written
    result = build_engine(config, cache_dir=cache)
    attrs = result.phase_table["actual_total_time"].attributes
    assert attrs[Attr.CACHE_PATTERN] == "kv_profile=miss, page_cache=hit" and Attr.ETA_FIRST_READY_S in attrs
    assert probe_cache_pattern(config, cache) == {"kv_profile": HIT}
    second = plan_start(config, cache)
    # Only the cold start is recorded: the hit is the model's (not the cold profiling's time), the rest recorded.
    assert second.estimate is not None and not second.estimate.unknown
    assert second.estimate.sources["kv_cache_profiling"].kind == "model"
    assert second.estimate.sources["load_weights"].kind == "recorded"


class _Probing:
    def __init__(self, name: str, caches: tuple[str, ...], answer: dict[str, str] | Exception) -> None:
        self.name, self.caches, self._answer = name, caches, answer
        self.needs: tuple[str, ...] = ()
        self.provides: tuple[str, ...] = ()

    def cache_probe(self, ctx: Any) -> dict[str, str]:
        if isinstance(self._answer, Exception):
            raise self._answer
        return self._answer

    def run(self, ctx: Any) -> Any:  # pragma: no cover - never run here
        raise AssertionError


def test_a_probe_that_cannot_tell_is_unknown_or_a_miss_on_an_empty_cache(tiny_dir, tmp_path: Path) -> None:
    from glowplug.base.artifacts.caches import KV_PROFILE
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.startup import probe_cache_pattern

    config = EngineConfig.from_flat(model=str(tiny_dir("llama")), compile="off")
    stages = [_Probing("a", ("compile",), {"compile": HIT}), _Probing("b", ("kv_profile",), RuntimeError("?"))]
    assert probe_cache_pattern(config, tmp_path, stages) == {"compile": HIT, "kv_profile": MISS}
    ArtifactStore(tmp_path).put(KV_PROFILE, {"other": 1}, group=model_group(config.model), build=lambda folder: None)
    assert probe_cache_pattern(config, tmp_path, stages)["kv_profile"] == UNKNOWN


# ---------------------------------------------------------------- real processes


def _startup(model: Path, cache: Path, report: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "glowplug.cli",
            "startup",
            str(model),
            "--compile",
            "off",
            "--kv-profile",
            "measure",
            "--quiet",
            "--report-out",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GLOWPLUG_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    rows = {k: data["phases"][k] for k in ("process_start", "imports")}
    return {"actual": data["actual_total_time"], "rows": rows, **data["attributes"]["actual_total_time"]}


def test_cold_warm_warm_then_emptied_cold_each_first_eta_from_its_own_kind(tiny_dir, tmp_path: Path) -> None:
    """The first ETA of each start (taken as the stages begin, after the imports) comes from the last start with
    the same cache hits: the second warm start from the first warm one, and a cold start after the cache was
    emptied from the cold one, not from the warm start just before it."""
    model, cache = tiny_dir("llama"), tmp_path / "cache"
    cold = _startup(model, cache, tmp_path / "cold.json")
    assert cold[Attr.CACHE_PATTERN] == "kv_profile=miss, page_cache=hit"
    assert "start-up model" in cold[Attr.ETA_BASIS]  # nothing recorded yet: the model's first ETA
    warm1 = _startup(model, cache, tmp_path / "warm1.json")
    assert warm1[Attr.CACHE_PATTERN] == "kv_profile=hit, page_cache=hit"
    assert "from the last cold start" not in warm1[Attr.ETA_BASIS]  # the cold record never passes for a warm one
    warm2 = _startup(model, cache, tmp_path / "warm2.json")
    assert warm2[Attr.ETA_BASIS] == "from the last warm start of this config"
    # The stages' part of its ETA is warm1's recorded wall time and tail (the records are newest first).
    warm1_record = StartRecord.from_json(_profile_records(cache)[1])
    assert warm1_record.pattern is not None and warm1_record.pattern["kv_profile"] == HIT
    assert warm1_record.wall_s is not None and warm1_record.tail_s is not None
    assert warm2[Attr.ETA_FIRST_STAGES_S] == pytest.approx(warm1_record.wall_s + warm1_record.tail_s, abs=1e-5)
    # Two separately timed starts on a shared machine: the ETA is the right size, not to the percent.
    assert warm2[Attr.ETA_FIRST_READY_S] <= 2.0 * warm2["actual"]

    # Before a start, without torch: the entries the last start used are still there, so the prediction is the
    # warm one, from the warm record.
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.start_profile import predict_before_start

    config = EngineConfig.from_flat(model=str(model), compile="off", kv_profile="measure")
    before = predict_before_start(config, cache)
    assert before.pattern["kv_profile"] == HIT and before.estimate is not None
    assert before.estimate.kind == "same_pattern" and before.estimate.before_s is not None

    records = {r["pattern"]["kv_profile"]: r for r in _profile_records(cache)}
    # warm2's own record (the newest): what a server waits for after starting a core is the imports row and the
    # plan up to the first stage, within process creation -> that stage (the process_start row comes first); and
    # its stages' wall time and the tail after them add up to the table's time to READY.
    newest = StartRecord.from_json(_profile_records(cache)[0])
    imports_s, before_s = newest.imports_s, newest.before_s
    assert imports_s is not None and before_s is not None
    assert warm2["rows"]["imports"] <= imports_s < before_s
    assert before_s - imports_s == pytest.approx(warm2["rows"]["process_start"], abs=0.05)
    assert newest.wall_s is not None and newest.tail_s is not None
    assert before_s + newest.wall_s + newest.tail_s == pytest.approx(warm2["actual"], abs=0.01)
    for kept in cache.iterdir():  # empty the cache, keeping only the start-up profile (the ETA's record)
        if kept.name != "startup_profile":
            shutil.rmtree(kept) if kept.is_dir() else kept.unlink()
    emptied = predict_before_start(config, cache)
    assert emptied.pattern["kv_profile"] == MISS  # the entry the warm starts used is gone
    assert emptied.estimate is not None and emptied.estimate.basis == "from the last cold start of this config"
    again = _startup(model, cache, tmp_path / "cold2.json")
    assert again[Attr.CACHE_PATTERN] == "kv_profile=miss, page_cache=hit"
    assert again[Attr.ETA_BASIS] == "from the last cold start of this config"
    cold_record = StartRecord.from_json(records[MISS])
    warm_record = StartRecord.from_json(records[HIT])
    # The stages' part of the ETA is the cold start's (its wall time), not the warm start's.
    assert cold_record.wall_s is not None and cold_record.tail_s is not None
    assert again[Attr.ETA_FIRST_STAGES_S] == pytest.approx(cold_record.wall_s + cold_record.tail_s, abs=1e-5)
    assert cold_record.stages["kv_cache_profiling"] != warm_record.stages["kv_cache_profiling"]


def _profile_records(cache: Path) -> list[dict[str, Any]]:
    (entry,) = [p for p in (cache / "startup_profile").iterdir() if not p.name.startswith(".")]
    return json.loads((entry / "phases.json").read_text())["records"]
