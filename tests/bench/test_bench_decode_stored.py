"""The decode report re-rendered from a stored run's JSON: a real short run on the default model (2 repeats, compiled,
batch 1/4/16 at 64 tokens and batch 1 at 512, both llama.cpp peers, the batch-invariance check, --targets),
made on a shared 2-core machine whose neighbours were busy, so its figures are noisy; what is checked is that every
column, section and verdict follows from the stored runs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from conftest import assert_no_blank_or_nan, markdown_cells

from glowplug.profiling.bench.decode import (
    BATCH1_VS_LLAMACPP,
    BATCH16_VS_BATCH1,
    PREFILL_VS_LLAMACPP,
    DecodeBenchConfig,
    DecodeRow,
    DecodeRun,
    decode_verdicts,
    main,
    render_markdown,
)

FIXTURE = Path(__file__).parent / "fixtures" / "decode47" / "decode.json"


def _run() -> DecodeRun:
    return DecodeRun.from_dict(json.loads(FIXTURE.read_text()))


def _main_table(text: str) -> dict[str, list[str]]:
    table = [r for r in markdown_cells(text) if r[0] in ("engine", "glowplug")]
    return {name: [r[i] for r in table[1:]] for i, name in enumerate(table[0])}


def _cell(rows: list[DecodeRow], compile_: str, batch: int, context: int) -> DecodeRow:
    return next(r for r in rows if r.compile == compile_ and r.batch == batch and r.context == context)


def test_the_stored_run_round_trips_through_its_json() -> None:
    data = json.loads(FIXTURE.read_text())
    assert DecodeRun.from_dict(data).as_dict() == data


def test_every_column_and_section_follows_from_the_stored_runs() -> None:
    run = _run()
    text = render_markdown(
        run.rows, run.cfg, ["bench", "decode", "--from-json", str(FIXTURE)], run.facts, from_json=FIXTURE
    )
    assert_no_blank_or_nan(text)
    assert f"Re-rendered from `{FIXTURE}`: the runs were made by `glowplug bench decode smollm2" in text
    cols = _main_table(text)
    measured = [r for r in run.rows if not r.skipped]
    assert len(cols["batch"]) == len(measured)
    # The prefill columns: prompt tokens over the prefill's time, and FLOP/s against the peak the run recorded.
    peak = run.facts.peak_flops
    assert peak is not None and f"Compute peak (the prefill's % of peak): {run.facts.peak_text()}." in text
    for i, r in enumerate(measured):
        tps = statistics.median(r.batch * r.context / (ms / 1e3) for ms in r.prefill_ms)
        assert cols["prefill tok/s"][i].startswith(f"{tps:.1f} ("), (cols["prefill tok/s"][i], tps)
        assert r.prefill_flops is not None
        share = statistics.median(100 * r.prefill_flops / (ms / 1e3) / peak for ms in r.prefill_ms)
        assert cols["% of int8 peak"][i].startswith(f"{share:.1f} (")
        # Shares of the bandwidth are against the sustained probe (each run's median pass), never the fastest.
        assert all(s <= f for s, f in zip(r.probe_gbps, r.probe_fastest_gbps))
        bw = statistics.median(100 * r.mb_per_token / ms / p for ms, p in zip(r.step_ms, r.probe_gbps))
        assert cols["% of probe"][i].startswith(f"{bw:.1f} (")
    sustained = [p for r in measured for p in r.probe_gbps]
    assert f"sustained {statistics.median(sustained):.1f} GB/s" in text and "fastest pass" in text
    for label in ("llama.cpp", "llama.cpp batched"):
        assert f"- peer {label}: llama-cpp-python 0.3.36; llama_print_system_info: CPU :" in text
    # The peers' own table: every paired cell, the prefill ratio as the peer's time over glowplug's.
    peer_rows = [r for r in markdown_cells(text) if len(r) == 16 and r[6].startswith("llama.cpp")]
    b1 = _cell(run.rows, "on", 1, 512)
    batched = next(p for p in b1.peers if p.label == "llama.cpp batched")
    ratios = [p / g for g, p in zip(b1.prefill_ms, batched.prefill_ms)]
    row = next(r for r in peer_rows if r[0] == "on" and r[4] == "1" and r[5] == "512" and r[6] == "llama.cpp batched")
    assert row[14:16] == [f"{statistics.median(ratios):.2f}x", f"{min(ratios):.2f}x"]
    # The batch-invariance table, with the batch-16 step it ran at.
    inv = run.facts.invariance[0]
    b16 = _cell(run.rows, inv.compile, 16, 64)
    line = next(
        ln for ln in text.splitlines() if ln.startswith(f"| {inv.compile} | {inv.dtype} | auto |") and "/8" in ln
    )
    assert f"| {inv.equal}/8 | {inv.reversed_equal}/8 |" in line and f"{b16.ms:.2f} (context 64)" in line


def test_the_verdicts_hold_each_target_to_its_worst_pair() -> None:
    run = _run()
    verdicts = {v.target: v for v in decode_verdicts(run.rows, run.cfg, run.facts)}
    for compile_ in dict.fromkeys(r.compile for r in run.rows):
        one, sixteen, pp = (
            _cell(run.rows, compile_, 1, 64),
            _cell(run.rows, compile_, 16, 64),
            _cell(run.rows, compile_, 1, 512),
        )
        what = f"{compile_}/{one.dtype}/auto/KV auto"
        for peer in one.peers:
            worst = min(g / p for g, p in zip(one.tokens_per_s, peer.tokens_per_s))
            v = verdicts[f"batch-1 decode >= 1.05x {peer.label} ({what}, context 64)"]
            assert f"worst pair {worst:.2f}x (n=2)" in v.measured and v.passed is (worst >= BATCH1_VS_LLAMACPP)
        worst = min(a / b for a, b in zip(sixteen.tokens_per_s, one.tokens_per_s))
        v = verdicts[f"batch-16 aggregate decode >= 6x glowplug's batch 1 ({what}, context 64)"]
        assert f"worst pair {worst:.2f}x" in v.measured and v.passed is (worst >= BATCH16_VS_BATCH1)
        (batched,) = [p for p in sixteen.peers if not p.skipped]
        worst = min(g / p for g, p in zip(sixteen.tokens_per_s, batched.tokens_per_s))
        v = verdicts[f"batch-16 aggregate decode >= 1.2x llama.cpp batched at 16 sequences ({what})"]
        assert f"worst pair {worst:.2f}x" in v.measured and v.passed is (worst >= 1.2)
        for peer in pp.peers:
            worst = min(p / g for g, p in zip(pp.prefill_ms, peer.prefill_ms))
            v = verdicts[f"prefill of 512 tokens >= 2x {peer.label}'s pp512 ({what})"]
            assert f"worst pair {worst:.2f}x" in v.measured and v.passed is (worst >= PREFILL_VS_LLAMACPP)
        shares = [100 * one.mb_per_token / ms / p for ms, p in zip(one.step_ms, one.probe_gbps)]
        v = next(
            v
            for t, v in verdicts.items()
            if t.startswith(f"batch-1 decode >= 85% of sustained probe / bytes per token ({what}")
        )
        assert v.measured.startswith(f"worst run {min(shares):.1f}%") and v.passed is (min(shares) >= 85)
        assert verdicts[f"batch invariance costs <= 5% of the batch-16 step ({what})"].passed is None
    for inv in run.facts.invariance:
        v = next(
            v for t, v in verdicts.items() if t.startswith("batch invariance: 8 prompts") and f"({inv.compile}/" in t
        )
        assert v.passed is (inv.equal == inv.reversed_equal == 8)
    # Without --targets only the older targets apply (none of these cells is at 2,048 tokens).
    assert decode_verdicts(run.rows, run.cfg.model_copy(update={"targets": False}), run.facts) == []


def test_main_rerenders_the_stored_run_and_leaves_its_verdicts_for_bench_all(tmp_path: Path) -> None:
    from glowplug.profiling.bench.all import Step, missed_targets
    from glowplug.profiling.bench.verdicts import failed_targets, sidecar

    out = tmp_path / "real" / "decode.md"
    assert main(DecodeBenchConfig(from_json=FIXTURE, out=out), ["bench", "decode", "--from-json", str(FIXTURE)]) == 0
    assert "## Verdicts" in out.read_text()
    assert json.loads(out.with_suffix(".json").read_text()) == json.loads(FIXTURE.read_text())
    run = _run()
    failed = [v.target for v in decode_verdicts(run.rows, run.cfg, run.facts) if v.passed is False]
    assert sidecar(out).is_file() and failed_targets(out) == failed
    step = Step("real-decode", [], ["real/decode.md"], "")
    assert missed_targets(step, tmp_path, since=0.0) == failed
