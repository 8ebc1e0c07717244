"""Tensor parallelism against TP=1 (engine/parallel.py): the sharded model over real gloo processes computes the
logits the whole model computes, for every kind of linear layer and for the vocab-split head."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glowplug.engine.models.arch import load_arch
from glowplug.engine.parallel import SINGLE, TPShard, check_tensor_parallel, shard_checkpoint, valid_tp_sizes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import tp_math_worker  # noqa: E402


def _run_ranks(world: int, tmp: Path, cases: list[str]) -> dict[str, torch.Tensor]:
    out = tmp / f"logits-{world}.pt"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).parent / "tp_math_worker.py"),
                str(r),
                str(world),
                str(tmp / f"rdv-{world}"),
                str(out),
                *cases,
            ],
            env=env,
        )
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * world
    return torch.load(out)


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from glowplug.engine.models.tiny import make_tiny_checkpoint

    mk = tmp_path_factory.mktemp
    return {
        # 4 heads over 2 KV heads (TP=2: one KV head each), untied head; vocab 320
        "llama": make_tiny_checkpoint(mk("tp-llama"), "llama"),
        # a tied head (the vocab-split embedding is the head), q/k/v biases
        "qwen2": make_tiny_checkpoint(mk("tp-qwen2"), "qwen2"),
        # one KV head: replicated on every rank
        "mqa": make_tiny_checkpoint(mk("tp-mqa"), "llama", num_key_value_heads=1),
        # 6 heads over 3 KV heads, head_dim 16, intermediate 192: splits 3 ways (320 vocab rows do not: padded)
        "six": make_tiny_checkpoint(
            mk("tp-six"),
            "llama",
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=16,
            hidden_size=96,
            intermediate_size=192,
        ),
        # the same with one KV head, tied: replicated on the three ranks
        "six1": make_tiny_checkpoint(
            mk("tp-six1"),
            "llama",
            num_attention_heads=6,
            num_key_value_heads=1,
            head_dim=16,
            hidden_size=96,
            intermediate_size=192,
            tie_word_embeddings=True,
        ),
        # 8 heads over 2 KV heads, wide enough that every split at TP=4 falls on 32-column groups (o_proj: 64 input
        # columns per rank, down_proj: 128): each KV head serves two ranks
        "wide": make_tiny_checkpoint(
            mk("tp-wide"),
            "llama",
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            hidden_size=256,
            intermediate_size=512,
        ),
    }


CASES = {
    2: [
        ("llama", "none", None),
        ("qwen2", "none", None),
        ("mqa", "none", None),
        ("llama", "int8", 32),
        ("qwen2", "int4", 32),
        ("llama", "int4", 32),
    ],
    3: [("six", "none", None), ("six1", "none", None), ("six", "int8", 32), ("six1", "int4", 32)],
    4: [("llama", "none", None), ("wide", "none", None), ("wide", "int8", 32), ("wide", "int4", 32)],
}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_logits_equal_whole_model(world: int, tp_models: dict[str, Path], tmp_path: Path) -> None:
    specs = [f"{m}-{s}-{g}:{tp_models[m]}:{s}:{g if g else '-'}" for m, s, g in CASES[world]]
    got = _run_ranks(world, tmp_path, specs)
    for m, s, g in CASES[world]:
        want = tp_math_worker.logits(tp_math_worker.build(tp_models[m], SINGLE, s, g))
        have = got[f"{m}-{s}-{g}"]
        assert have.shape == want.shape
        # fp32 throughout: only the order of the row-parallel sums differs.
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4, msg=f"{m} {s} g{g} at TP={world}")
        assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_shard_math_smollm2_heads(smollm2_dir: Path) -> None:
    arch = load_arch(smollm2_dir)
    assert (arch.num_attention_heads, arch.num_key_value_heads) == (9, 3)
    splits = [TPShard(r, 3).heads(arch) for r in range(3)]
    assert [(s.q_start, s.q_heads, s.kv_start, s.kv_heads) for s in splits] == [
        (0, 3, 0, 1),
        (3, 3, 1, 1),
        (6, 3, 2, 1),
    ]
    assert valid_tp_sizes(arch, None, limit=9) == [1, 3]  # 9 would split 1536 intermediate columns unevenly
    msg = check_tensor_parallel(arch, 2, None)
    assert msg is not None and "9 attention heads are not divisible by 2" in msg and "sizes that do: 1, 3" in msg


def test_replicated_kv_heads_follow_query_groups() -> None:
    from glowplug.engine.models.arch import ModelArch

    a = ModelArch.model_construct(num_attention_heads=8, num_key_value_heads=2, head_dim=16, intermediate_size=64)
    # 8 query heads in 2 groups of 4 (KV head = query // 4); at TP=4 rank r has query heads 2r, 2r+1.
    for r in range(4):
        s = TPShard(r, 4).heads(a)
        assert s.kv_heads == 1 and s.kv_start == (2 * r) // 4


def test_group_boundaries_refused() -> None:
    from glowplug.engine.models.arch import ModelArch

    a = ModelArch.model_construct(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)
    assert check_tensor_parallel(a, 2, 32) is None
    msg = check_tensor_parallel(a, 4, 32)  # o_proj's 64 inputs -> 16 per rank, half a group
    assert msg is not None and "64 splits into 16 columns per rank" in msg and "sizes that do: 1, 2" in msg
    assert "per-channel" in (check_tensor_parallel(a, 2, "per channel") or "")


def _greedy(config_fields: dict, cache: Path, prompt: str, tokens: int) -> tuple[list[int], object]:
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.sampling_params import SamplingParams
    from glowplug.engine.startup import build_engine

    result = build_engine(EngineConfig.from_flat(**config_fields), cache_dir=cache)
    try:
        eng = result.engine
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        eng.add_request(prompt, params, request_id="tp")
        out: list[int] = []
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    out = list(o.outputs[0].token_ids)
        return out, result
    finally:
        if result.parallel is not None:
            result.parallel.close()


def test_smollm2_tp3_greedy_equals_tp1(smollm2_dir: Path, tmp_path: Path) -> None:
    """The default model (9 heads, 3 KV heads: one per rank) at fp32, TP=3 against TP=1, 64 greedy tokens."""
    fields = dict(
        model="smollm2", dtype="float32", quantization="none", kv_cache_memory="64MiB", max_model_len=512, compile="off"
    )  # eager on both sides: TP runs the decode step eagerly
    prompt = "The three laws of thermodynamics say that"
    want, _ = _greedy(fields, tmp_path, prompt, 64)
    got, result = _greedy({**fields, "tensor_parallel_size": 3}, tmp_path, prompt, 64)
    assert len(want) == 64 and got == want
    assert result.stages[0].name == "distributed_init"


def test_refused_at_config_time_with_the_valid_sizes(tiny_dir) -> None:
    from glowplug.engine.config import ConfigError, EngineConfig
    from glowplug.engine.config_check import _tp_group, check_tensor_parallel_config, preflight

    with pytest.raises(ConfigError, match=r"9 attention heads are not divisible by 2; sizes that do: 1, 3"):
        preflight(EngineConfig.from_flat(model="smollm2", tensor_parallel_size=2))
    arch = load_arch(tiny_dir("llama"))
    per_channel = EngineConfig.from_flat(model="x", quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="per-channel format.*pass --group-size"):
        check_tensor_parallel_config(per_channel, arch, _tp_group(per_channel, None))
    grouped = EngineConfig.from_flat(model="x", quantization="int4", group_size=64, tensor_parallel_size=2)
    # o_proj: 4 heads x 16 = 64 inputs, 32 per rank: half a 64-weight group
    with pytest.raises(ConfigError, match="width 64 splits into 32 columns per rank, not a multiple of the 64"):
        check_tensor_parallel_config(grouped, arch, _tp_group(grouped, 64))
    with pytest.raises(ConfigError, match="--compile on"):
        check_tensor_parallel_config(EngineConfig.from_flat(model="x", compile="on", tensor_parallel_size=2), arch)


def test_tp2_start_is_one_trace_and_the_table_names_the_slower_rank(tp_models: dict[str, Path], tmp_path: Path) -> None:
    from glowplug.engine.config import EngineConfig
    from glowplug.engine.startup import build_engine
    from glowplug.profiling.names import STARTUP_SPAN, Attr
    from glowplug.profiling.tracing import setup_tracing

    tracing = setup_tracing()
    config = EngineConfig.from_flat(
        model=str(tp_models["llama"]), tensor_parallel_size=2, dtype="float32", num_gpu_blocks_override=64
    )
    result = build_engine(config, tracing=tracing, cache_dir=tmp_path)
    result.parallel.close()
    spans = [s for s in tracing.finished_spans() if s.name.startswith(STARTUP_SPAN + ".")]
    by_rank: dict[int, dict[str, object]] = {0: {}, 1: {}}
    for s in spans:
        by_rank[s.attributes[Attr.RANK]][s.name.removeprefix(STARTUP_SPAN + ".")] = s
    assert {s.context.trace_id for s in spans} == {result.phase_table.trace_id and int(result.phase_table.trace_id, 16)}
    stages = {"model_prepare", "load_weights", "model_init", "kv_cache_init", "warmup"}
    assert stages <= set(by_rank[0]) and stages <= set(by_rank[1])
    assert all(s.attributes[Attr.WORLD_SIZE] == 2 for s in spans)
    row = result.phase_table["load_weights"]
    took = {r: (by_rank[r]["load_weights"].end_time - by_rank[r]["load_weights"].start_time) / 1e9 for r in (0, 1)}
    assert row.attributes[Attr.TP_SLOWEST_RANK] == max(took, key=took.get)
    assert row.attributes[Attr.TP_SPREAD_S] == pytest.approx(abs(took[0] - took[1]), abs=1e-5)
    arrived = {r: by_rank[r]["kv_cache_init"].start_time for r in (0, 1)}
    total = result.phase_table["actual_total_time"]
    assert total.attributes[Attr.TP_HELD_BACK_RANK] == max(arrived, key=arrived.get)
    assert any("held READY back" in n for n in total.notes)


def test_chrome_trace_has_one_lane_group_per_rank() -> None:
    from glowplug.profiling.export import chrome_trace
    from glowplug.profiling.names import STARTUP_SPAN, Attr
    from glowplug.profiling.tracing import RankAttributes, setup_tracing

    tracing = setup_tracing()
    tracer = tracing.tracer()
    for rank in (0, 1):
        stamp = RankAttributes(rank, 2)
        with tracer.start_as_current_span(STARTUP_SPAN) as root:
            stamp.on_start(root)
            with tracer.start_as_current_span(STARTUP_SPAN + ".load_weights") as span:
                stamp.on_start(span)
    events = chrome_trace(tracing.finished_spans())["traceEvents"]
    names = {e["args"]["name"]: e["pid"] for e in events if e.get("name") == "process_name"}
    assert set(names) == {"glowplug rank 0", "glowplug rank 1"}
    for rank in (0, 1):
        pids = {e["pid"] for e in events if e.get("ph") == "X" and e["args"][Attr.RANK] == rank}
        assert pids == {names[f"glowplug rank {rank}"]}


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_packed_column_slices_equal_the_slices_quantized(scheme: str) -> None:
    """A row-parallel layer that arrives packed (a GGUF's blocks, repacked; a stored quantized shard) is sliced
    along its input in whole groups: the slice of the packed tensors is the packing of the slice."""
    from glowplug.engine.models.arch import ModelArch
    from glowplug.kernels.registry import get_scheme

    arch = ModelArch.model_construct(
        num_attention_heads=6, num_key_value_heads=3, head_dim=16, intermediate_size=192, vocab_size=10
    )
    torch.manual_seed(0)
    w = torch.randn(40, 192)
    s = get_scheme(scheme)
    packed = s.quantize_state_dict({"model.layers.0.mlp.down_proj.weight": w}, group_size=32, quantize_head=False)
    packed = {k: v for k, v in packed.items() if not k.endswith(".weight")}
    for rank in range(3):
        mine = shard_checkpoint(packed, arch, TPShard(rank, 3))
        want = s.quantize_state_dict(
            {"model.layers.0.mlp.down_proj.weight": w[:, rank * 64 : (rank + 1) * 64]},
            group_size=32,
            quantize_head=False,
        )
        for k, v in mine.items():
            assert torch.equal(v, want[k]), (k, rank)
