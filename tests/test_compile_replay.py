"""The replayed decode step (engine/compile_replay.py): a warm start runs the compiled kernels without Dynamo or
Inductor, bit for bit what torch's own AOT-compiled step computes, and falls back to that step when it cannot."""

from __future__ import annotations

import json
from pathlib import Path

import cache_faults_util as util
import pytest
import torch
from startup_probe import SlotProbe

from glowplug.base.artifacts.manifest import read_manifest, record_file, write_manifest
from glowplug.engine.compile import CompiledDecode
from glowplug.engine.compile_cache import _clear_inductor_memory
from glowplug.engine.compile_replay import PLAN_FILE, ReplayDecode, ReplayPlan, ReplayUnavailable
from glowplug.engine.compile_replay_plan import _rewrite
from glowplug.engine.config import EngineConfig
from glowplug.engine.models.tiny import make_tiny_checkpoint
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.startup import build_engine, default_stages
from glowplug.profiling.names import Attr
from glowplug.profiling.tracing import setup_tracing

COMPILE = {"compile": "on", "max_num_seqs": 4}


@pytest.mark.slow
def test_warm_start_replays_without_dynamo_or_inductor_and_falls_back(tiny_dir, tmp_path: Path) -> None:
    """Fresh processes (a process that compiled keeps Inductor's modules loaded): cold writes the plan; warm loads
    it, imports neither Dynamo nor Inductor by READY, and generates the cold start's tokens. With a kernel library
    the plan names deleted, the start falls back to the AOT artifact and still generates the same tokens."""
    model, cache = str(tiny_dir("llama")), tmp_path / "cache"
    args = {"model": model, "cache": str(cache), "config": COMPILE}
    cold = util.worker_result(util.run_worker(args), timeout=900)
    assert cold["attrs"]["graph_compile"][Attr.COMPILE_REPLAY] == "written"
    assert any(m.startswith("torch._inductor") for m in cold["compiler_modules_at_ready"])

    warm = util.worker_result(util.run_worker(args))
    assert warm["attrs"]["graph_compile"][Attr.COMPILE_REPLAY] == "loaded"
    assert warm["attrs"]["graph_compile"][Attr.CACHE_HIT] is True
    assert warm["attrs"]["dynamo_transform"][Attr.CACHE_HIT] is True
    assert warm["compiler_modules_at_ready"] == []
    assert warm["tokens"] == cold["tokens"]
    # The plan's fingerprint was replayed before serving, and its cost is on the span.
    assert warm["attrs"]["graph_compile"][Attr.REPLAY_FINGERPRINT] == "matched"
    assert 0 < warm["attrs"]["graph_compile"][Attr.REPLAY_FINGERPRINT_S] < 5

    (entry,) = util.entries(cache, "compile")
    (ws,) = util.entries(cache, "inductor")
    plan = ReplayPlan.from_json((entry / PLAN_FILE).read_bytes())
    (ws / next(iter(plan.kernels.values()))[1]).unlink()
    healed = util.worker_result(util.run_worker(args), timeout=900)
    assert healed["attrs"]["graph_compile"][Attr.COMPILE_REPLAY].startswith("would not load")
    assert healed["tokens"] == cold["tokens"]
    again = util.worker_result(util.run_worker(args))  # Inductor rebuilt the library where the plan expects it
    assert again["attrs"]["graph_compile"][Attr.COMPILE_REPLAY] == "loaded" and again["tokens"] == cold["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{"dtype": "float32"}, {"quantization": "int4", "kv_cache_dtype": "int8"}])
def test_replay_equals_the_aot_step_bit_for_bit(tiny_dir, tmp_path: Path, fields: dict[str, str]) -> None:
    """Against torch's own compiled step (the oracle), on the real cache at every batch size 1..8, sequences at
    different lengths crossing 4-token blocks: the same logits and the same cache writes, bit for bit."""
    cfg = EngineConfig.from_flat(model=str(tiny_dir("llama")), block_size=4, **{**COMPILE, "max_num_seqs": 8, **fields})
    # Inductor would reuse kernels this process loaded from another test's cache folder; a plan can only name
    # libraries in its own folder (a start in a fresh process, the product's case, never meets this).
    _clear_inductor_memory()
    tracing = setup_tracing()
    probe = SlotProbe(("decode_fn", "compile_cache"))
    result = build_engine(cfg, cache_dir=tmp_path, tracing=tracing, stages=[*default_stages(), probe])
    eng, decode_fn, compile_cache = result.engine, probe.seen["decode_fn"], probe.seen["compile_cache"]
    assert isinstance(decode_fn, CompiledDecode)  # a cold start serves the AOT-compiled step
    (span,) = [s for s in tracing.finished_spans() if s.name == "glowplug.startup.graph_compile"]
    assert span.attributes[Attr.COMPILE_REPLAY] == "written", span.attributes[Attr.COMPILE_REPLAY]
    (entry,) = util.entries(tmp_path, "compile")
    replay = ReplayDecode.load(ReplayPlan.from_json((entry / PLAN_FILE).read_bytes()), compile_cache.path, eng.model)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for n in (3, 4, 7, 8, 11, 2, 5, 9):
        eng.add_request(None, params, prompt_token_ids=list(range(5, 5 + n)))
    eng.step()  # the prefills
    scheduled = eng.runner.apply(eng.scheduler.schedule())
    caches = eng.runner.kv_cache.layers
    serve = replay.serving(caches)
    with torch.inference_mode():
        for batch in range(1, len(scheduled) + 1):
            packed = eng.runner.prepare_decode(scheduled[:batch]).clone()
            want = decode_fn.unguarded(packed, caches).clone()
            written = [(c.k.clone(), c.v.clone()) for c in caches]
            assert replay.guards_pass(packed, caches), replay.guard_failure(packed, caches)
            assert torch.equal(serve(packed), want), batch
            assert all(torch.equal(c.k, k) and torch.equal(c.v, v) for c, (k, v) in zip(caches, written))
    assert "int64" in replay.guard_failure(packed.to(torch.int32), caches)
    for s in scheduled:
        eng.abort(s.seq.request_id)


def _entry_of(cache: Path, model: str) -> Path:
    from glowplug.engine.models.store import model_group

    (entry,) = [e for e in util.entries(cache, "compile") if read_manifest(e).group == model_group(model)]
    return entry


@pytest.mark.slow
def test_a_plan_running_another_valid_kernel_library_is_caught_by_its_fingerprint(tiny_dir, tmp_path: Path) -> None:
    """The plan's kernel libraries are swapped for those of another valid compiled graph: the same model compiled
    for another config (rms_norm_eps 0.25: the same kernels and arguments, other numbers), in the same Inductor
    folder, and the entry's manifest re-recorded so the store finds it sound. The fingerprint check at load does
    not: the replay is rejected with a cache_corrupt event, the start loads the entry's AOT artifact (which does
    reproduce the fingerprint) and generates the tokens of the uncached start."""
    model = str(tiny_dir("llama"))
    other = tmp_path / "eps"
    other.mkdir()
    make_tiny_checkpoint(other, "llama", rms_norm_eps=0.25)
    cache = tmp_path / "cache"
    cold = util.worker_result(util.run_worker({"model": model, "cache": str(cache), "config": COMPILE}), timeout=900)
    assert cold["attrs"]["graph_compile"][Attr.COMPILE_REPLAY] == "written"
    util.worker_result(util.run_worker({"model": str(other), "cache": str(cache), "config": COMPILE}), timeout=900)
    entry = _entry_of(cache, model)
    mine = ReplayPlan.from_json((entry / PLAN_FILE).read_bytes())
    theirs = ReplayPlan.from_json((_entry_of(cache, str(other)) / PLAN_FILE).read_bytes())
    swapped = {
        name: theirs.kernels[name]
        for name, lib in mine.kernels.items()
        if name in theirs.kernels and theirs.kernels[name] != lib
    }
    assert swapped, "the other config compiled other kernel libraries"
    raw = json.loads((entry / PLAN_FILE).read_bytes())
    raw["kernels"].update(swapped)
    (entry / PLAN_FILE).write_text(json.dumps(raw))
    manifest = read_manifest(entry)
    write_manifest(
        entry, manifest.model_copy(update={"files": {**manifest.files, PLAN_FILE: record_file(entry / PLAN_FILE)}})
    )

    warm = util.worker_result(util.run_worker({"model": model, "cache": str(cache), "config": COMPILE}))
    attrs = warm["attrs"]["graph_compile"]
    assert attrs[Attr.COMPILE_REPLAY].startswith("rejected (the replayed step does not reproduce"), attrs[
        Attr.COMPILE_REPLAY
    ]
    assert attrs[Attr.REPLAY_FINGERPRINT].startswith("logits differ") and attrs[Attr.REPLAY_FINGERPRINT].endswith(
        "the AOT artifact: matched"
    ), attrs[Attr.REPLAY_FINGERPRINT]
    assert attrs[Attr.CACHE_HIT] is True  # served from the same entry's AOT artifact
    (event,) = [e for e in warm["events"] if e["event"] == "cache_corrupt"]
    assert event["stage"] == "graph_compile" and event[Attr.CACHE_NAME] == "compile"
    assert "does not reproduce the logits" in event[Attr.CACHE_REASON]
    assert warm["tokens"] == cold["tokens"]


def test_a_wrapper_with_other_kernels_gets_no_plan(tmp_path: Path) -> None:
    """A GPU wrapper defines Triton kernels, which the replay cannot load: no plan (warm starts use the AOT
    artifact), with the reason named."""
    source = (
        "from torch._inductor.async_compile import AsyncCompile\nasync_compile = AsyncCompile()\n"
        "triton_poi_0 = async_compile.triton('triton_poi_0', '''\\n@triton.jit\\ndef k(): pass\\n''')\n"
    )
    with pytest.raises(ReplayUnavailable, match="triton"):
        _rewrite(source, torch, tmp_path)
