"""The cache fault matrix: every cache x every damage, each from a good warm cache, each a real start-up.

In every case the start reaches READY, its greedy output is identical to a clean start's, and the damage shows as a
`cache_corrupt` event (path and reason) on the span of the stage that met it and in the phase table's note. An
entry made under another torch version is not damage: it is a miss explained by the factor that changed (or a hit,
for the caches that do not depend on torch). Two writers filling the same entries at once leave one good entry
each and no temporary leftovers.

Model conversion is stood in for by copying a tiny checkpoint (the real one takes 25 s); everything else is real.
The compile cases run each start in a fresh process, since Inductor keeps what it loaded in memory.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cache_faults_util as util
import pytest
import torch

from glowplug.base.artifacts import ArtifactStore
from glowplug.base.artifacts.caches import by_name
from glowplug.profiling.names import Attr

CACHES = ("model", "quant", "kv_profile", "startup_profile", "kernel_dispatch")
# One config exercises all five: a .gguf model (model cache), int8 (quant + kernel dispatch), the KV profile and
# the start-up profile every start has.
# kv_profile measure: the KV profile is one of the caches under test (the analytic default uses none).
CONFIG = {"quantization": "int8", "compile": "off", "max_num_seqs": 4, "kv_profile": "measure"}
# The stage that reads each cache (the start-up profile is written after the last stage, under the root span).
READER = {
    "model": "model_prepare",
    "quant": "quantize_weights",
    "kv_profile": "kv_cache_profiling",
    "startup_profile": "glowplug.startup",
    "kernel_dispatch": "model_init",
    "compile": "dynamo_transform",
    "inductor": "dynamo_transform",
}
ROW = {
    "model_prepare": "model_prepare",
    "quantize_weights": "quantize_weights",
    "model_init": "model_init",
    "kv_cache_profiling": "kv_cache_profiling",
    "glowplug.startup": "actual_total_time",
    "dynamo_transform": "dynamo_transform_time",
}


_worker, _result = util.run_worker, util.worker_result


@pytest.fixture(scope="module")
def gguf(tiny_dir, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A stand-in .gguf file and the tiny checkpoint its "conversion" yields."""
    src = tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf"
    src.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    return src, tiny_dir("llama")


@pytest.fixture(scope="module")
def warm(gguf, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A warm cache holding an entry of each of the five caches, and the greedy output of clean starts:
    without a calibrated dispatch table (`default`) and with one (`calibrated`)."""
    src, tiny = gguf
    from glowplug.engine.models import store

    patch = pytest.MonkeyPatch()
    patch.setattr(store, "_convert_gguf", util.fake_converter(tiny))
    cache = tmp_path_factory.mktemp("warm")
    cold = util.start(str(src), cache, CONFIG)
    from glowplug.engine.models.arch import load_arch
    from glowplug.engine.stages.context import EngineContext
    from glowplug.engine.stages.model_init import layer_shapes
    from glowplug.kernels.dispatch import calibrate

    ctx = EngineContext()
    ctx.arch = load_arch(tiny)
    calibrate(layer_shapes(ctx), cache, repeats=1, stream_bytes=1 << 16)
    again = util.start(str(src), cache, CONFIG)
    assert again["attrs"]["model_init"]["glowplug.kernel_dispatch"].startswith("calibrated")
    for stage in ("model_prepare", "quantize_weights", "kv_cache_profiling"):
        assert again["attrs"][stage][Attr.CACHE_HIT] is True, stage
    assert all(len(util.entries(cache, c)) == 1 for c in CACHES)
    yield {"cache": cache, "default": cold["tokens"], "calibrated": again["tokens"], "src": src, "tiny": tiny}
    patch.undo()


def _copy(warm: dict[str, Any], tmp_path: Path) -> Path:
    case = tmp_path / "cache"
    shutil.copytree(warm["cache"], case)  # copy2 keeps mtimes, so checkpoint stamps (quant factors) still match
    return case


def _corrupt_events(res: dict[str, Any], cache: str) -> list[dict[str, Any]]:
    return [e for e in res["events"] if e["event"] == "cache_corrupt" and e[Attr.CACHE_NAME] == cache]


@pytest.mark.parametrize("damage", util.DAMAGES)
@pytest.mark.parametrize("cache_name", CACHES)
def test_damaged_entry_is_a_miss_rebuilt_and_reported(
    warm, tmp_path: Path, cache_name: str, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from glowplug.engine.models import store

    monkeypatch.setattr(store, "_convert_gguf", util.fake_converter(warm["tiny"]))
    cache = _copy(warm, tmp_path)
    (entry,) = util.entries(cache, cache_name)
    if damage == "garbage_manifest":
        (entry / "manifest.json").write_bytes(b"\x00{not json at all")
    elif damage.startswith("stale"):
        entry = util.make_stale(entry, damage)
    else:
        util.damage_file(entry / util.DATA_FILE[cache_name], damage)

    res = util.start(str(warm["src"]), cache, CONFIG)  # READY, or this raises

    # Without a usable dispatch table the engine uses the built-in rules, so the clean start to compare with is
    # the uncalibrated one.
    assert res["tokens"] == (warm["default"] if cache_name == "kernel_dispatch" else warm["calibrated"])
    assert util.leftovers(cache) == []
    stage = READER[cache_name]
    store = ArtifactStore(cache)
    spec = by_name(cache_name)
    if damage == "stale_torch":
        assert not _corrupt_events(res, cache_name), "an entry from another torch version is not damage"
        if "torch" in json.loads((entry / "manifest.json").read_text())["factors"]:
            if cache_name == "kernel_dispatch":
                assert "torch '2.0.0' -> " in res["attrs"][stage]["glowplug.kernel_dispatch"]
            else:
                assert "torch '2.0.0' -> " in res["attrs"][stage][Attr.CACHE_MISS_REASON]
        elif cache_name != "startup_profile":  # the profile is rewritten by every start: no hit to speak of
            assert res["attrs"][stage][Attr.CACHE_HIT] is True, "this cache does not depend on torch"
        return
    events = _corrupt_events(res, cache_name)
    assert len(events) == 1 and events[0]["stage"] == stage, res["events"]
    assert events[0][Attr.CACHE_PATH] == str(entry) and events[0][Attr.CACHE_REASON]
    assert any(n.startswith(f"cache_corrupt ({cache_name})") for n in res["notes"][ROW[stage]])
    # Moved aside, and (except the calibration, which only `glowplug bench kernels` makes) rebuilt sound.
    assert any(p.name.startswith(f"{cache_name}-") for p in (cache / ".quarantine").iterdir())
    if cache_name == "kernel_dispatch":
        assert util.entries(cache, cache_name) == []
    else:
        (rebuilt,) = util.entries(cache, cache_name)
        assert store.check_entry(rebuilt, spec, mode="full")[1] is None


# ---------------------------------------------------------------- two writers at once


@pytest.fixture(scope="module")
def two_writers(gguf, warm, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two processes start the same config at the same instant on an empty cache; two more calibrate at once."""
    src, tiny = gguf
    cache = tmp_path_factory.mktemp("two-writers")
    from glowplug.engine.models.arch import load_arch
    from glowplug.engine.stages.context import EngineContext
    from glowplug.engine.stages.model_init import layer_shapes

    ctx = EngineContext()
    ctx.arch = load_arch(tiny)
    shapes = [list(s) for s in layer_shapes(ctx)]
    at = time.time() + 8  # both are past their imports by then
    procs = [
        _worker({"model": str(src), "cache": str(cache), "config": CONFIG, "fake_gguf_from": str(tiny), "start_at": at})
        for _ in range(2)
    ]
    starts = [_result(p) for p in procs]
    cal_cache = tmp_path_factory.mktemp("two-calibrators")
    at = time.time() + 8
    cals = [
        _result(p) for p in [_worker({"cache": str(cal_cache), "calibrate": shapes, "start_at": at}) for _ in range(2)]
    ]
    return {"cache": cache, "starts": starts, "cal_cache": cal_cache, "cals": cals}


@pytest.mark.parametrize("cache_name", CACHES)
def test_two_writers_leave_one_good_entry(two_writers, warm, cache_name: str) -> None:
    cache = two_writers["cal_cache"] if cache_name == "kernel_dispatch" else two_writers["cache"]
    if cache_name == "kernel_dispatch":
        a, b = two_writers["cals"]
        assert a["measured"] == b["measured"]
    else:
        for res in two_writers["starts"]:
            assert res["tokens"] == warm["default"]  # no calibration in this cache: the built-in rules
            assert not res["events"], res["events"]
    (entry,) = util.entries(cache, cache_name)
    assert ArtifactStore(cache).check_entry(entry, by_name(cache_name), mode="full")[1] is None
    assert util.leftovers(cache) == []
    assert not (cache / ".quarantine").exists()


# ---------------------------------------------------------------- the compile cache (Inductor), fresh processes

COMPILE = {"compile": "on", "max_num_seqs": 4}


@pytest.fixture(scope="module")
def warm_compiled(tiny_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cache = tmp_path_factory.mktemp("warm-compiled")
    model = str(tiny_dir("llama"))
    res = _result(_worker({"model": model, "cache": str(cache), "config": COMPILE}))
    assert res["attrs"]["graph_compile"][Attr.CACHE_HIT] is False
    (ws,) = util.entries(cache, "inductor")
    assert list(ws.rglob("*.so")), "the compiled kernels are in the verified Inductor folder"
    return {"cache": cache, "model": model, "tokens": res["tokens"]}


@pytest.mark.slow
@pytest.mark.parametrize("damage", [*util.DAMAGES, "two_writers", "truncated_unverified"])
def test_compile_cache_faults_reach_ready(warm_compiled, tmp_path: Path, damage: str) -> None:
    """truncated_unverified: the kernels are truncated to their first KiB in an Inductor folder with no manifest
    (an older glowplug's, or one whose manifest was deleted), so nothing catches them before they are loaded: the
    replay plan's load fails, and Inductor, behind the AOT artifact, hits its graph cache and then compiles the
    kernels it cannot load again: the start books that as a miss and reports it."""
    model = warm_compiled["model"]
    if damage == "two_writers":
        cache = tmp_path / "cache"
        at = time.time() + 8
        procs = [_worker({"model": model, "cache": str(cache), "config": COMPILE, "start_at": at}) for _ in range(2)]
        for res in [_result(p, timeout=900) for p in procs]:
            assert res["tokens"] == warm_compiled["tokens"] and not res["events"]
        for name in ("compile", "inductor"):
            (entry,) = util.entries(cache, name)
            assert ArtifactStore(cache).check_entry(entry, by_name(name), mode="full")[1] is None
        assert util.leftovers(cache) == []
        return
    # Damage the warm cache where it was written, and put it back afterwards: Inductor keys compiled kernels by
    # their build command, which names the cache folder, so in a copy the damaged kernels would never be read.
    cache = warm_compiled["cache"]
    pristine = tmp_path / "pristine"
    shutil.copytree(cache, pristine, symlinks=True)
    try:
        _damage_compile_cache_and_start(warm_compiled, cache, damage)
    finally:
        shutil.rmtree(cache)
        shutil.copytree(pristine, cache, symlinks=True)


def _damage_compile_cache_and_start(warm_compiled: dict[str, Any], cache: Path, damage: str) -> None:
    model = warm_compiled["model"]
    (index,) = util.entries(cache, "compile")
    (ws,) = util.entries(cache, "inductor")
    if damage == "garbage_manifest":
        for e in (index, ws):
            (e / "manifest.json").write_bytes(b"\x00{not json at all")
    elif damage.startswith("stale"):
        util.make_stale(index, damage)
        util.make_stale(ws, damage)
    elif damage == "truncated_unverified":
        (ws / "manifest.json").unlink()
        # Cut inside the ELF header: the dynamic loader refuses such a file. (A cut past the headers, into the
        # loadable segments, is not refused: glibc maps the missing pages and the process dies of SIGBUS, which no
        # cache check after the load can catch; that is what the manifest's size check is for.)
        for so in ws.rglob("*.so"):
            so.write_bytes(so.read_bytes()[:32])
    else:
        for so in ws.rglob("*.so"):  # every compiled kernel, as in the report
            util.damage_file(so, damage)

    res = _result(_worker({"model": model, "cache": str(cache), "config": COMPILE}), timeout=900)

    assert res["tokens"] == warm_compiled["tokens"]
    if damage in ("truncated", "bitflip", "empty", "missing", "truncated_unverified"):
        # The replay plan names kernel libraries that were moved aside (or, unverified, will not load): the start
        # falls back to the AOT artifact, which has Inductor rebuild them.
        assert res["attrs"]["graph_compile"][Attr.COMPILE_REPLAY].startswith("would not load"), res["attrs"][
            "graph_compile"
        ]
    assert util.leftovers(cache) == []
    if damage == "stale_torch":
        assert not res["events"]
        assert "torch '2.0.0' -> " in res["attrs"]["graph_compile"][Attr.CACHE_MISS_REASON]
        return
    events = [e for e in res["events"] if e["event"] == "cache_corrupt"]
    assert events and {e[Attr.CACHE_NAME] for e in events} <= {"compile", "inductor"}, res["events"]
    assert all(e[Attr.CACHE_PATH] and e[Attr.CACHE_REASON] for e in events)
    if damage == "truncated_unverified":
        # (The replay plan's refused load and Inductor's rebuild may each be reported: both on the inductor entry.)
        assert all(e["stage"] == "graph_compile" and e[Attr.CACHE_NAME] == "inductor" for e in events), events
        assert any("Inductor rebuilt" in e[Attr.CACHE_REASON] for e in events), events
        assert res["attrs"]["graph_compile"][Attr.CACHE_HIT] is False
        assert any(n.startswith("cache_corrupt (inductor)") for n in res["notes"]["graph_compile_general_shape"])
    else:
        assert any(n.startswith("cache_corrupt (") for n in res["notes"]["dynamo_transform_time"])
    (ws,) = util.entries(cache, "inductor")
    assert ArtifactStore(cache).check_entry(ws, by_name("inductor"), mode="full")[1] is None


def test_failed_compile_is_retried_once_in_a_fresh_inductor_folder(tiny_dir, tmp_path: Path) -> None:
    """A compile that fails with the cached artifacts is retried cold in a new folder (the old one quarantined,
    one cache_corrupt event); a second failure is a real compile error and is raised."""
    from glowplug.engine.compile import InductorSettings
    from glowplug.engine.compile_cache import open_compile_cache
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.models.arch import load_arch
    from glowplug.profiling.tracing import setup_tracing

    tracing = setup_tracing(in_memory=True)
    model = tiny_dir("llama")
    # No model: with no stored artifact in this fresh cache, nothing is loaded for one.
    args = (EngineConfig.from_flat(model=str(model)), load_arch(model), torch.float32, "cpu", InductorSettings(), None)
    cache = open_compile_cache(tmp_path, *args)
    (cache.path / "stale.so").write_bytes(b"not a library")
    calls: list[Path] = []

    def flaky() -> str:
        calls.append(cache.path)
        if len(calls) == 1:
            raise RuntimeError("CppCompileError: cannot load stale.so")
        return "compiled"

    with tracing.provider.get_tracer("test").start_as_current_span("glowplug.startup.graph_compile"):
        assert cache.run(flaky) == "compiled"
    assert len(calls) == 2 and not (cache.path / "stale.so").exists()
    (span,) = [s for s in tracing.finished_spans() if s.name == "glowplug.startup.graph_compile"]
    (ev,) = [e for e in span.events if e.name == "cache_corrupt"]
    assert "compile failed with these cached artifacts" in ev.attributes[Attr.CACHE_REASON]
    assert list((tmp_path / ".quarantine").iterdir()), "the old folder is kept aside, not deleted"

    def broken() -> str:
        raise RuntimeError("a real compile error")

    with pytest.raises(RuntimeError, match="a real compile error"):
        open_compile_cache(tmp_path, *args).run(broken)
