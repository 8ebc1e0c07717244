"""The real-size decode report's parts that need no engine: the sustained bandwidth probe and its statistics, the
compute peak, the run-by-run pairing and its worst pair, the cells grid, the prefill's FLOP count (against torch's
FLOP counter on a transformers model), and llama.cpp's batched peer (against the library's own generator loop)."""

from __future__ import annotations

import importlib.util
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from glowplug.base.machine import ProbeStats, l3_cache_bytes, measure_probe, measure_probe_stats, probe_size
from glowplug.profiling.bench.decode import DecodeBenchConfig, prefill_flops
from glowplug.profiling.bench.machine import compute_peak, cpu_clock
from glowplug.profiling.bench.peers import PeerRuns, pair_ratios, paired_ratio


def _cache(root: Path, cpu: int, index: int, level: int, size: str, shared: str) -> None:
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    (d / "level").write_text(f"{level}\n")
    (d / "size").write_text(f"{size}\n")
    (d / "shared_cpu_list").write_text(f"{shared}\n")


def test_l3_counts_each_shared_instance_once(tmp_path: Path) -> None:
    """Two L3 slices of 32 MiB, each shared by two CPUs (sysfs lists it under both): 64 MiB, not 128; L1 and L2 are
    not the last level."""
    for cpu in range(4):
        shared = "0-1" if cpu < 2 else "2-3"
        _cache(tmp_path, cpu, 0, 1, "32K", str(cpu))
        _cache(tmp_path, cpu, 2, 2, "512K", str(cpu))
        _cache(tmp_path, cpu, 3, 3, "32768K", shared)
    assert l3_cache_bytes(tmp_path) == 64 << 20
    assert probe_size(64 << 20) == 1 << 30  # 4 x 64 MiB is below the 1 GiB floor
    assert probe_size(512 << 20) == 2 << 30  # a large L3: the probe reads 4x it
    assert l3_cache_bytes(tmp_path / "none") is None and probe_size(None) == 1 << 30


def test_sustained_is_the_median_pass_and_fastest_the_maximum() -> None:
    stats = ProbeStats((20.0, 9.0, 21.0, 19.5, 30.0), 1 << 30, 32 << 20)  # one disturbed pass, one lucky one
    assert stats.sustained == 20.0 and stats.fastest == 30.0
    assert ProbeStats((10.0, 12.0), 1 << 30).sustained == 11.0
    assert "1024 MiB" in stats.describe() and "32x the 32 MiB L3" in stats.describe() and "5 passes" in stats.describe()


def test_the_probe_measures_every_pass_it_is_asked_for() -> None:
    stats = measure_probe_stats(passes=3, size_bytes=16 << 20)
    assert len(stats.passes_gbps) == 3 and all(p > 0 for p in stats.passes_gbps)
    assert min(stats.passes_gbps) <= stats.sustained <= stats.fastest == max(stats.passes_gbps)
    assert stats.size_bytes == 16 << 20
    assert measure_probe(2, 16 << 20) > 0  # the fastest pass, for the callers that want the best case


def test_cpu_clock_prefers_cpufreq_and_falls_back_to_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\ncpu MHz\t\t: 2445.404\nprocessor\t: 1\ncpu MHz\t\t: 2600.000\n")
    assert cpu_clock(tmp_path / "sys", info) == (pytest.approx(2.6e9), "/proc/cpuinfo cpu MHz")
    freq = tmp_path / "sys" / "cpu0" / "cpufreq"
    freq.mkdir(parents=True)
    (freq / "cpuinfo_max_freq").write_text("3500000\n")  # kHz
    assert cpu_clock(tmp_path / "sys", info) == (pytest.approx(3.5e9), "cpufreq cpuinfo_max_freq")


def test_compute_peak_is_cores_times_clock_times_the_levels_int8_macs() -> None:
    peak = compute_peak("avx2", 2)
    assert peak.macs_per_cycle == 32 and peak.flops == pytest.approx(2 * 2 * peak.clock_hz * 32)
    assert compute_peak("amx", 1).macs_per_cycle == 1024 and compute_peak("avx512", 1).macs_per_cycle == 64
    assert "vpmaddubsw" in peak.describe() and "GFLOP/s" in peak.describe()


def test_pairs_are_taken_in_run_order_and_the_worst_is_the_smallest() -> None:
    """glowplug 100, 90, 120 against a peer's 50, 60, 40 in the same runs: pairs 2.0, 1.5, 3.0. Sorting both lists
    first would pair 90 with 40 and report a worst of 2.0: a drift between runs would pass for a speed-up."""
    peer = PeerRuns("llama.cpp", [50.0, 60.0, 40.0], [20.0, 16.7, 25.0], prefill_ms=[400.0, 300.0, 500.0])
    r = paired_ratio([100.0, 90.0, 120.0], peer)
    assert r is not None and (r.median, r.worst, r.n) == (2.0, 1.5, 3)
    # The prefill: the peer's time over glowplug's, run by run (above 1: glowplug faster).
    assert peer.prefill_ratios([100.0, 150.0, 100.0]) == [4.0, 2.0, 5.0]
    pp = pair_ratios(peer.prefill_ms, [100.0, 150.0, 100.0])
    assert pp is not None and (pp.median, pp.worst) == (4.0, 2.0)
    # A peer with fewer runs pairs only the runs both have; none at all is no ratio (and so no verdict).
    assert pair_ratios([1.0, 2.0, 3.0], [1.0]) == pair_ratios([1.0], [1.0])
    assert pair_ratios([], []) is None


def test_cells_run_in_the_given_order_and_name_the_lists() -> None:
    cfg = DecodeBenchConfig(cells=("1x64", "16x64", "1x512", "1x2048"), peer_contexts=(64, 512))
    assert cfg.grid() == [(1, 64), (16, 64), (1, 512), (1, 2048)]
    assert cfg.batch_sizes == (1, 16) and cfg.prompt_tokens == (64, 512, 2048)
    assert cfg.peer_at(64) and cfg.peer_at(512) and not cfg.peer_at(2048)
    plain = DecodeBenchConfig(batch_sizes=(1, 4), prompt_tokens=(64, 512))
    assert plain.grid() == [(1, 64), (1, 512), (4, 64), (4, 512)] and plain.peer_at(64) and not plain.peer_at(512)
    with pytest.raises(ValidationError, match="cell 1x64 is not in --batch-sizes"):
        DecodeBenchConfig(cells=("1x64",), prompt_tokens=(512,))
    with pytest.raises(ValidationError, match=r"--peer-contexts \[128\] are not among --prompt-tokens"):
        DecodeBenchConfig(cells=("1x64",), peer_contexts=(128,))
    with pytest.raises(ValidationError, match="cells"):
        DecodeBenchConfig(cells=("16by64",))


def test_prefill_flops_match_torchs_counter_on_a_transformers_model(tiny_dir: Callable[[str], Path]) -> None:
    """The oracle: torch's FLOP counter over transformers' forward of the same architecture, the LM head on the last
    position only (logits_to_keep=1), as a prefill samples. Its eager attention multiplies the whole T x T score
    matrix where the causal mask zeroes half, so it counts twice the attention FLOPs prefill_flops does."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from glowplug.engine.models.arch import load_arch

    folder = tiny_dir("llama")
    arch = load_arch(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    batch, tokens = 2, 24
    ids = torch.randint(0, arch.vocab_size, (batch, tokens))
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(ids, logits_to_keep=1)
    counted = counter.get_total_flops()
    attention = 2 * batch * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim * tokens * tokens
    assert counted == pytest.approx(prefill_flops(arch, batch, tokens) + attention, rel=1e-9)


needs_llamacpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp is not installed")


@needs_llamacpp
def test_the_batched_peer_decodes_what_llamacpps_own_loop_decodes() -> None:
    """At batch 1 the batched API's greedy tokens are the generator loop's (the same library, the same model), and a
    batch of several sequences yields a token per sequence per step; its info names the build flags."""
    import torch

    from glowplug.engine.models.store import resolve_model
    from glowplug.profiling.bench.peers import LlamaCppBatchedPeer, LlamaCppPeer, load_llamacpp_peers

    gen, batched = load_llamacpp_peers(
        resolve_model("smollm2", quiet=True), ["llamacpp", "llamacpp-batched"], 64, torch.get_num_threads()
    )
    assert isinstance(gen, LlamaCppPeer) and isinstance(batched, LlamaCppBatchedPeer)
    try:
        prompt = [1, 504, 3120, 282, 4649, 314]
        own = list(
            itertools.islice(
                gen.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True), 10
            )
        )
        timing, tokens = batched.generate([prompt], 10)
        assert tokens == [own]
        assert timing.tokens_per_s > 0 and timing.prefill_ms > 0
        timing, tokens = batched.generate([prompt, prompt[:3], prompt[2:]], 6)
        assert [len(t) for t in tokens] == [6, 6, 6]
        assert timing.tokens_per_s == pytest.approx(3 * 5 / (timing.step_ms * 5 / 1e3))
        assert "n_batch = n_ubatch = 512" in batched.info and "llama_print_system_info" in batched.info
        assert batched.held_bytes == 0 and gen.held_bytes > 0  # one model in the process, counted once
    finally:
        batched.close()


def test_a_stored_decode_json_is_read_whether_a_run_or_a_bare_row_list() -> None:
    from glowplug.profiling.bench.decode import json_rows

    rows = [{"engine": "glowplug", "batch": 1}]
    assert json_rows(rows) == rows and json_rows(json.loads(json.dumps({"config": {}, "rows": rows}))) == rows
