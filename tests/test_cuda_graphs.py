"""CUDA-graph capture owned by the runner, on a GPU (skipped without one; scripts/device_check.sh runs these):
one graph per bucket over the static input buffer, replay equal to the eager step, no recompiles across buckets,
and the KV profile measured by the CUDA allocator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from glowplug.engine.config import EngineConfig
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.startup import build_engine
from glowplug.profiling.names import Attr
from glowplug.profiling.tracing import setup_tracing

pytestmark = pytest.mark.cuda

PROMPTS = ["The scheduler", "A", "glowplug starts", "emoji 🚀", "x y z", "Numbers 0 1 2", "The quick", "B"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cuda-cache")


def _start(model: Path, cache: Path, **fields: object) -> Any:
    fields = {
        "compile": "on",
        "max_num_seqs": 8,
        "device": "cuda",
        "dtype": "float32",
        "block_size": 4,
        "kv_cache_memory": "256MiB",
        **fields,
    }
    return build_engine(EngineConfig.from_flat(model=str(model), **fields), tracing=setup_tracing(), cache_dir=cache)


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def test_capture_per_bucket_and_serving_keeps_eager_tokens(tiny_dir, cache: Path, make_llm) -> None:
    model = tiny_dir("llama")
    started = _start(model, cache)
    row = started.phase_table["graph_capturing"]
    attrs = row.attributes
    assert list(attrs[Attr.GRAPH_SIZES]) == [1, 2, 4, 8], row.reason
    assert len(attrs[Attr.GRAPH_SIZE_TIMES_S]) == 4 and all(t > 0 for t in attrs[Attr.GRAPH_SIZE_TIMES_S])
    pools = list(attrs[Attr.GRAPH_SIZE_POOL_BYTES])
    assert len(pools) == 4 and attrs[Attr.GRAPH_POOL_BYTES] == sum(pools) and attrs[Attr.GRAPH_POOL_BYTES] > 0
    eng = started.engine
    assert eng.runner.decode_sizes == (1, 2, 4, 8)
    unique = _unique_graphs()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs: dict[str, list[int]] = {}
    for k in (1, 3, 5, 8):  # 3 and 5 run padded to the 4 and 8 buckets
        for p in PROMPTS[:k]:
            eng.add_request(p, params)
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs.setdefault(o.prompt, o.outputs[0].token_ids)
    assert _unique_graphs() == unique, "a request traced a new graph"
    eager = make_llm(model, compile="off", block_size=4, device="cuda", dtype="float32", kv_cache_memory="256MiB")
    for p, out in zip(PROMPTS, eager.generate(PROMPTS, params)):
        assert outs[p] == out.outputs[0].token_ids, p


def test_replay_of_a_padded_bucket_equals_the_eager_step(tiny_dir, cache: Path) -> None:
    started = _start(tiny_dir("llama"), cache)
    eng = started.engine
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for n in (3, 4, 7, 8, 11):
        eng.add_request(None, params, prompt_token_ids=list(range(5, 5 + n)))
    eng.step()
    scheduled = eng.runner.apply(eng.scheduler.schedule())
    runner = eng.runner
    packed = runner.prepare_decode(scheduled, pad_to=8).clone()  # 5 rows padded to the 8 bucket
    caches = runner.kv_cache.layers
    before = [(c.k.clone(), c.v.clone()) for c in caches]
    with torch.inference_mode():
        got = runner.decode_step(packed).clone()
        for c, (k, v) in zip(caches, before):
            c.k.copy_(k)
            c.v.copy_(v)
        want = runner.eager_decode(packed)
    torch.testing.assert_close(got[:5], want[:5], atol=2e-4, rtol=2e-4)
    for s in scheduled:
        eng.abort(s.seq.request_id)


def test_kv_profile_is_measured_by_the_allocator_and_follows_gpu_memory_utilization(tiny_dir, cache: Path) -> None:
    model = tiny_dir("llama")
    a = _start(model, cache, compile="off", gpu_memory_utilization=0.1, kv_cache_memory=None)
    b = _start(model, cache, compile="off", gpu_memory_utilization=0.05, kv_cache_memory=None)
    prof = a.phase_table["kv_cache_profiling"]
    assert "cuda_allocator" in str(prof.attributes), prof.attributes
    assert a.engine.stats().kv_blocks > b.engine.stats().kv_blocks


def test_a_cache_larger_than_32_bit_indexing_is_capped_and_the_compiled_step_still_captures(
    tiny_dir, cache: Path
) -> None:
    """The tiny model's few bytes per token make 0.5 x an H100 tens of millions of blocks: the plan caps them (the
    row says so) so that the compiled step's 32-bit-indexing guards hold and capture succeeds."""
    started = _start(tiny_dir("llama"), cache, kv_cache_memory=None, gpu_memory_utilization=0.5)
    prof = started.phase_table["kv_cache_profiling"].attributes
    assert "2**31 elements" in str(prof["glowplug.kv_budget_source"]), prof
    assert list(started.phase_table["graph_capturing"].attributes[Attr.GRAPH_SIZES]) == [1, 2, 4, 8]


def test_the_graph_pool_is_read_from_the_allocator_snapshot(tiny_dir, cache: Path) -> None:
    """After capture the runner reads its graphs' pool from torch.cuda.memory_snapshot: new segments made during
    the captures (so no more than the reserved growth they caused), holding at least every graph's logits output,
    and each size's activations measured by the allocator's peak grow with the batch."""
    started = _start(tiny_dir("llama"), cache)
    attrs = started.phase_table["graph_capturing"].attributes
    usage = started.engine.runner.graph_pool_usage()
    assert usage is not None and usage.segments >= 1
    assert 0 < usage.reserved_bytes <= attrs[Attr.GRAPH_POOL_BYTES]
    assert attrs[Attr.GRAPH_POOL_RESERVED_BYTES] == usage.reserved_bytes
    vocab = started.arch.vocab_size
    assert usage.allocated_bytes >= sum(attrs[Attr.GRAPH_SIZES]) * vocab * 4  # fp32 logits of every graph
    acts = list(attrs[Attr.GRAPH_SIZE_ACTIVATION_BYTES])
    assert len(acts) == 4 and all(a > 0 for a in acts) and acts[-1] > acts[0], acts
    assert "pool / activations" in str(attrs[Attr.ROW_NOTE])
