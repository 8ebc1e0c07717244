"""The decode report's peers (paired ratios, llama.cpp's decode-time definition), memory split and seed-003 lines,
checked on hand-made timings (no engine)."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import assert_no_blank_or_nan, markdown_cells

from glowplug.profiling.bench import decode as decode_mod
from glowplug.profiling.bench.decode import DecodeBenchConfig, DecodeRow, render_markdown
from glowplug.profiling.bench.peers import (
    PeerRuns,
    PeerTiming,
    SkippedPeer,
    load_llamacpp_peer,
    time_llamacpp_decode,
)


def _row(tps: list[float], batch: int = 1, quant: str = "none") -> DecodeRow:
    row = DecodeRow(
        "glowplug",
        "on",
        "bfloat16",
        quant,
        batch,
        list(tps),
        [1000 / t for t in tps],
        [20.0] * len(tps),
        50.0,
        context=64,
        max_model_len=192,
    )
    row.peak_gb = [1.0 + i * 0.1 for i in range(len(tps))]
    row.run_at = [f"2026112712000{i}" for i in range(len(tps))]
    row.prefill_ms = [5.0] * len(tps)
    row.host_ms = [0.5] * len(tps)
    row.weights_gb, row.kv_pool_gb, row.peers_gb, row.rss_before_gb = 0.3, 0.5, 0.1, 0.8
    return row


def _table(text: str) -> dict[str, list[str]]:
    table = [r for r in markdown_cells(text) if r[0] in ("engine", "glowplug")]
    return {name: [r[i] for r in table[1:]] for i, name in enumerate(table[0])}


def test_peer_column_is_the_median_of_paired_ratios_and_its_worst_pair() -> None:
    """glowplug 100, 90, 120 against a peer's 50, 45, 40 in the same runs: ratios 2.0, 2.0, 3.0, so the median is
    2.00x and the worst pair 2.00x; dividing the medians instead would say 100 / 45 = 2.22x."""
    row = _row([100.0, 90.0, 120.0])
    row.peers = [
        PeerRuns("transformers float32", [50.0, 45.0, 40.0], [20.0, 22.0, 25.0]),
        PeerRuns("llama.cpp", [100.0, 100.0, 100.0], [10.0, 10.0, 10.0]),
    ]
    text = render_markdown([row], DecodeBenchConfig(), None)
    assert_no_blank_or_nan(text)
    cols = _table(text)
    assert cols["vs transformers float32"] == ["2.00x (worst 2.00x, n=3)"]
    assert cols["vs llama.cpp"] == ["1.00x (worst 0.90x, n=3)"]  # 1.0, 0.9, 1.2: worst is the smallest
    peer_rows = [r for r in markdown_cells(text) if len(r) > 6 and r[6] in ("transformers float32", "llama.cpp")]
    assert [r[10:12] for r in peer_rows] == [["2.00x", "2.00x"], ["1.00x", "0.90x"]]


def test_a_peer_that_cannot_run_says_why_in_its_column() -> None:
    one, sixteen = _row([100.0, 100.0, 100.0]), _row([400.0, 400.0, 400.0], batch=16)
    one.peers = [PeerRuns("llama.cpp", [50.0, 50.0, 50.0], [20.0] * 3)]
    sixteen.peers = [PeerRuns("llama.cpp", skipped="the generator loop decodes one sequence")]
    text = render_markdown([one, sixteen], DecodeBenchConfig(), None)
    assert _table(text)["vs llama.cpp"] == [
        "2.00x (worst 2.00x, n=3)",
        "skipped: the generator loop decodes one sequence",
    ]
    assert SkippedPeer("llama.cpp", "no module").skip_reason(1) == "no module"


def test_each_repeat_times_glowplug_then_every_peer_after_one_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interleaving itself: probe, glowplug, peer A, peer B, then the next repeat, all on the same prompts."""
    calls: list[str] = []
    seen_prompts: list[Any] = []

    class FakePeer:
        held_bytes = 0

        def __init__(self, label: str, tps: float) -> None:
            self.label, self.tps = label, tps

        def skip_reason(self, batch: int) -> str | None:
            return None

        def time_run(self, prompts: list[list[int]], new_tokens: int) -> PeerTiming:
            calls.append(self.label)
            seen_prompts.append(prompts)
            return PeerTiming(self.tps, 1000 / self.tps, 7.0)

    def fake_engine(engine: Any, prompts: list[list[int]], new_tokens: int) -> Any:
        calls.append("glowplug")
        seen_prompts.append(prompts)
        return decode_mod.EngineDecodeTiming(100.0, 10.0, 5.0, 0.5)

    monkeypatch.setattr(decode_mod, "time_engine_decode", fake_engine)
    from glowplug.base.machine import ProbeStats

    monkeypatch.setattr(
        decode_mod,
        "measure_probe_stats",
        lambda device: calls.append("probe") or ProbeStats((18.0, 20.0, 21.0), 1 << 30),
    )
    cfg = DecodeBenchConfig(repeats=2, prompt_tokens=(64, 512))
    row, prompts = _row([]), [[1, 2, 3]]
    row.peak_gb, row.run_at, row.prefill_ms, row.host_ms = [], [], [], []
    decode_mod._time_cell(object(), row, prompts, cfg, "cpu", [FakePeer("A", 50.0), FakePeer("B", 25.0)])
    assert calls == ["probe", "glowplug", "A", "B"] * 2
    assert all(p is prompts for p in seen_prompts)
    assert [p.ratios(row.tokens_per_s) for p in row.peers] == [[2.0, 2.0], [4.0, 4.0]]
    assert row.probe_gbps == [20.0, 20.0] and row.probe_fastest_gbps == [21.0, 21.0]  # sustained = the median
    assert [p.prefill_ratios(row.prefill_ms) for p in row.peers] == [[1.4, 1.4]] * 2  # 7 ms against glowplug's 5
    # Away from the peer context (the first one) no peer runs.
    calls.clear()
    far = _row([])
    far.context, far.peak_gb, far.run_at, far.prefill_ms, far.host_ms = 512, [], [], [], []
    decode_mod._time_cell(object(), far, prompts, cfg, "cpu", [FakePeer("A", 50.0)])
    assert calls == ["probe", "glowplug"] * 2 and far.peers == []


class _FakeLlama:
    """llama-cpp-python's Llama as the peer uses it: reset(), then generate() yielding one token per eval. Each
    yield advances a fake clock: the prompt's eval by `prefill_s`, each later token by `step_s`."""

    def __init__(self, prefill_s: float, step_s: float) -> None:
        self.now, self.prefill_s, self.step_s = 0.0, prefill_s, step_s
        self.resets = 0
        self.kwargs: dict[str, Any] = {}

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens: list[int], **kw: Any) -> Iterator[int]:
        self.kwargs = kw
        self.now += self.prefill_s
        yield 1
        while True:
            self.now += self.step_s
            yield 2


def test_llamacpp_decode_time_leaves_out_the_prompt_and_the_first_token() -> None:
    llm = _FakeLlama(prefill_s=5.0, step_s=0.02)
    t = time_llamacpp_decode(llm, [1, 2, 3], 8, clock=lambda: llm.now)
    # 7 tokens after the first, 20 ms each: 50 tok/s; the 5 s prefill is nowhere in it, but is its own figure.
    assert t.tokens_per_s == pytest.approx(50.0) and t.step_ms == pytest.approx(20.0)
    assert t.prefill_ms == pytest.approx(5000.0)
    assert llm.resets == 1
    assert llm.kwargs["temp"] == 0.0 and llm.kwargs["repeat_penalty"] == 1.0  # greedy, no penalty


def test_llamacpp_peer_is_skipped_with_a_reason_when_the_module_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import raises ImportError
    peer = load_llamacpp_peer(tmp_path, n_ctx=256, n_threads=2)
    assert isinstance(peer, SkippedPeer)
    assert peer.skip_reason(1) is not None and peer.skip_reason(1).startswith("llama_cpp not importable")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama_cpp is not installed")
def test_llamacpp_peer_decodes_the_engines_gguf() -> None:
    import torch

    from glowplug.engine.models.store import resolve_model

    peer = load_llamacpp_peer(resolve_model("smollm2", quiet=True), n_ctx=64, n_threads=torch.get_num_threads())
    assert not isinstance(peer, SkippedPeer), peer.skip_reason(1)
    t = peer.time_run([[1, 2, 3, 4]], 8)
    assert t.tokens_per_s > 0 and t.step_ms == pytest.approx(1000 / t.tokens_per_s) and t.prefill_ms > 0
    assert peer.skip_reason(16) is not None and "one sequence" in peer.skip_reason(16)
    assert "llama_print_system_info" in peer.info and "AVX" in peer.info


def test_memory_split_counts_a_shared_storage_once_and_rest_is_what_is_left() -> None:
    import torch

    from glowplug.profiling.bench.memory_split import MemorySplit, held_weight_bytes, unique_storage_bytes

    base = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes
    assert unique_storage_bytes([base, base[:10], base.view(10, 100), torch.zeros(10, dtype=torch.bfloat16)]) == 4020
    lin = torch.nn.Linear(10, 20)  # 200 + 20 floats
    lin.register_buffer("alias", lin.weight.data[:5])  # a view of the weight: no extra bytes
    assert held_weight_bytes(lin) == 880
    split = MemorySplit(peak_bytes=3_000, weights_bytes=1_000, kv_bytes=1_500, peers_bytes=200)
    assert split.rest_bytes == 300 and split.as_gb()["rest"] == pytest.approx(3e-7)


def test_memory_split_columns_and_rest_per_run() -> None:
    row = _row([100.0, 100.0, 100.0])  # peaks 1.0, 1.1, 1.2 GB; weights 0.3, KV 0.5, peers 0.1
    assert row.rest_gb == pytest.approx([0.1, 0.2, 0.3])
    cols = _table(render_markdown([row], DecodeBenchConfig(compare_hf=False), None))
    assert (cols["weights GB"], cols["KV pool GB"], cols["peers GB"]) == (["0.300"], ["0.500"], ["0.100"])
    assert cols["rest GB"] == ["0.20 (0.10–0.30)"]
    assert row.as_dict()["rest_gb"] == pytest.approx([0.1, 0.2, 0.3])


def test_seed_003_lines_one_per_run_with_their_own_numbers_and_a_repro() -> None:
    row = _row([100.0, 125.0], quant="int4")  # steps of 10 and 8 ms, 50 MB per step
    row.group_size = "g128"
    cfg = DecodeBenchConfig(compare_hf=False, group_size=128, new_tokens=16, device="cpu")
    text = render_markdown([row], cfg, None)
    lines = [line for line in text.splitlines() if ", tok/s=" in line]
    assert len(lines) == 2
    pat = re.compile(
        r"^(\d{14}), tok/s=\s*([\d.]+), mem/s=\s*([\d.]+) GB/s, peak_mem=\s*([\d.]+) GB, "
        r"model_size=([\d.]+) GB quant: int4, group: g128, .*kv_quant: False, compile: True, "
        r"dtype: torch.bfloat16, device: cpu, batch: 1, context: 64, cache_size: 192 "
        r"repro: (.*)$"
    )
    got = [pat.match(line) for line in lines]
    assert all(got), lines
    assert [float(m.group(2)) for m in got] == [100.0, 125.0]
    assert [float(m.group(3)) for m in got] == [5.0, 6.25]  # 50 MB / 10 ms, 50 MB / 8 ms
    assert [float(m.group(4)) for m in got] == [1.0, 1.1]
    repro = got[0].group(6).split()
    assert repro[:4] == ["glowplug", "bench", "decode", "smollm2"]
    assert repro[repro.index("--group-size") + 1] == "128" and repro[repro.index("--quantization") + 1] == "int4"
    assert repro[repro.index("--max-model-len") + 1] == "192" and "--no-compare-hf" in repro


def test_group_size_goes_to_the_integer_formats_only() -> None:
    from glowplug.engine.config import EngineConfig

    cfg = DecodeBenchConfig(group_size=128, quantization=("none", "int8", "int4", "int2", "auto"))
    for quant in ("none", "int8", "int4", "int2", "auto"):
        fields = decode_mod._engine_fields(cfg, "off", "bfloat16", quant, "auto", 256, "cpu")
        assert fields.get("group_size") == (128 if quant in ("int8", "int4", "int2") else None)
        EngineConfig.from_flat(**fields)  # the engine accepts every cell's fields


def test_hf_dtype_choices_map_to_torch_dtypes() -> None:
    import torch

    assert decode_mod.hf_peer_dtype("cpu") is torch.float32
    assert decode_mod.hf_peer_dtype("cuda") is torch.bfloat16
    assert decode_mod.hf_peer_dtype("cpu", "bfloat16") is torch.bfloat16
    assert DecodeBenchConfig(hf_dtype=("float32", "bfloat16"), peers=("llamacpp",)).hf_dtype == ("float32", "bfloat16")
