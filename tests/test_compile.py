"""torch.compile of the decode step: Dynamo and Inductor timed apart, a persistent cache, no compile at serve time."""

from __future__ import annotations

from pathlib import Path

import pytest

from glowplug.engine.config import EngineConfig
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.startup import build_engine
from glowplug.profiling.names import Attr
from glowplug.profiling.tracing import setup_tracing

pytestmark = pytest.mark.slow  # a cold Inductor compile (with its one-time toolchain probe) takes ~20 s here


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compile-cache")


def _start(model: Path, cache: Path, **fields: object):
    cfg = EngineConfig.from_flat(model=str(model), compile="on", max_num_seqs=8, **fields)
    tracing = setup_tracing()
    return build_engine(cfg, tracing=tracing, cache_dir=cache), tracing


def _compile_attrs(tracing) -> dict:
    span = next(s for s in tracing.finished_spans() if s.name == "glowplug.startup.graph_compile")
    return dict(span.attributes)


def test_cold_then_warm_then_changed(tiny_dir, cache: Path) -> None:
    model = tiny_dir("llama")
    cold, tr = _start(model, cache)
    t = cold.phase_table
    assert t.seconds("dynamo_transform_time") > 0 and t.seconds("graph_compile_general_shape") > 0
    assert t.seconds("graph_compile_cached") is None
    assert t["graph_compile_cached"].reason == "cache miss: first start for this model"
    assert t.seconds("torch.compile") == pytest.approx(
        t.seconds("dynamo_transform_time") + t.seconds("graph_compile_general_shape")
    )
    assert _compile_attrs(tr)[Attr.CACHE_HIT] is False

    warm, tr = _start(model, cache)
    t = warm.phase_table
    assert t.seconds("graph_compile_cached") > 0 and t.seconds("graph_compile_general_shape") is None
    assert t["graph_compile_general_shape"].reason == "cache hit"
    assert _compile_attrs(tr)[Attr.CACHE_HIT] is True
    assert t.seconds("graph_compile_cached") < cold.phase_table.seconds("graph_compile_general_shape")

    changed, tr = _start(model, cache, kv_cache_dtype="int8")
    attrs = _compile_attrs(tr)
    assert attrs[Attr.CACHE_HIT] is False
    reason = attrs[Attr.CACHE_MISS_REASON]
    # Only the factor that changed, down to the config field (the artifact store's explanation).
    assert reason == "changed: engine_config.cache.kv_cache_dtype 'auto' -> 'int8'"


def test_serving_never_compiles_and_matches_eager(tiny_dir, cache: Path, make_llm) -> None:
    model = tiny_dir("llama")
    compiled, _ = _start(model, cache)
    backend = compiled.context.backend
    n_graphs = len(backend.graphs)
    capture = compiled.phase_table["graph_capturing"].attributes
    assert list(capture[Attr.GRAPH_SIZES]) == [2, 4, 8] and len(capture[Attr.GRAPH_SIZE_TIMES_S]) == 3
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["The scheduler", "A", "glowplug starts", "emoji 🚀", "x y z", "Numbers 0 1 2", "The quick", "B"]
    eng = compiled.engine
    calls = {"n": 0}
    inner = eng.runner.decode_fn

    def counting(*args):
        calls["n"] += 1
        return inner(*args)

    eng.runner.decode_fn = counting
    outs = {}
    # Batches of every size from 1 to 8 (requests finish at different times as prompts differ).
    for k in range(1, 9):
        for p in prompts[:k]:
            eng.add_request(p, params)
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs.setdefault(o.prompt, o.outputs[0].token_ids)
    assert calls["n"] > 0
    assert len(backend.graphs) == n_graphs, "a request triggered a new compile"
    eager = make_llm(model, compile="off")
    for p, toks in zip(prompts, [o.outputs[0].token_ids for o in eager.generate(prompts, params)]):
        assert outs[p] == toks
