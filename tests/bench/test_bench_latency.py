"""`bench latency` on the tiny model: consistent TGI-style tables, and a batch that does not fit says why."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import assert_no_blank_or_nan, markdown_cells

from glowplug.profiling.bench.latency import LatencyBenchConfig, render_markdown, run_latency_bench, write_reports


def test_latency_tables(tiny_model: str, tmp_path: Path) -> None:
    cfg = LatencyBenchConfig(
        model=tiny_model,
        batch_size=(1, 2, 8),
        sequence_length=32,
        decode_length=6,
        runs=2,
        warmups=1,
        num_gpu_blocks_override=20,  # 8 x ceil((32 + 6 - 1) / 16) = 24 blocks: batch 8 cannot run
        out_dir=tmp_path / "out",
    )
    result = run_latency_bench(cfg)
    by_batch = {c.batch: c for c in result.cells}
    assert set(by_batch) == {1, 2, 8}
    assert by_batch[8].reason == "KV cache: needs 24 blocks, has 20"
    for batch in (1, 2):
        cell = by_batch[batch]
        assert cell.ok, cell.reason
        assert len(cell.prefill_s) == len(cell.decode_total_s) == cfg.runs
        assert len(cell.decode_token_s) == cfg.runs * (cfg.decode_length - 1)  # one sample per decode step
        assert all(v > 0 for v in cell.prefill_tokens_per_s + cell.decode_tokens_per_s)
        for prefill, req, tok in zip(cell.prefill_s, cell.prefill_requests_per_s, cell.prefill_tokens_per_s):
            assert req == pytest.approx(batch / prefill)  # seed 001's Prefill column
            assert tok == pytest.approx(req * cfg.sequence_length)  # glowplug's prompt tokens/s beside it
        assert cell.prefill_steps == 1  # the default step budget prefills the whole batch in one forward
        steps = cfg.decode_length - 1
        for i, total in enumerate(cell.decode_total_s):  # Decode (total) is its run's decode steps, plus loop time
            assert total >= sum(cell.decode_token_s[i * steps : (i + 1) * steps])

    paths = write_reports(result, ["bench", "latency"])
    md = (tmp_path / "out" / "latency.md").read_text()
    assert md.startswith("# Latency benchmark") and "- command: `glowplug bench latency`" in md
    assert_no_blank_or_nan(md)
    # Both tables of the quantization state the dtype and compile mode the engine resolved "auto" to.
    assert len(re.findall(r"Latency \(dtype (float32|bfloat16), compile (on|off), sequence length 32, decode", md)) == 1
    assert len(re.findall(r"Throughput \(dtype (float32|bfloat16), compile (on|off)\)", md)) == 1
    rows = markdown_cells(md)
    lat = [r for r in rows if r[0] in ("Prefill", "Decode (token)", "Decode (total)") and len(r) == 9]
    assert len(lat) == 9
    for r in lat:
        if r[1] == "8":
            assert all(c == "n/a (KV cache: needs 24 blocks, has 20)" for c in r[2:])
            continue
        assert int(r[2]) == (cfg.runs * (cfg.decode_length - 1) if r[0] == "Decode (token)" else cfg.runs)
        avg, low, high, p50, p90, p99 = (float(c.split()[0].replace(",", "")) for c in r[3:])
        assert low <= p50 <= p90 <= p99 <= high and low <= avg <= high
    # Throughput: one row per batch size, the seed's requests/s column beside glowplug's prompt tokens/s
    tput = {r[0]: r for r in rows if len(r) == 5 and r[0] in ("1", "2", "8")}
    assert set(tput) == {"1", "2", "8"} and tput["8"][2:] == ["n/a (KV cache: needs 24 blocks, has 20)"] * 3
    assert "| Batch Size | n (runs) | Prefill (requests/s) | Prefill (prompt tokens/s) | Decode (tokens/s) |" in md
    assert "seed 001's Prefill throughput under its own definition, batch / prefill latency" in md

    data = json.loads((tmp_path / "out" / "latency.json").read_text())
    assert data["percentile_method"].startswith("linear interpolation")
    from glowplug.profiling.bench.tables import fmt_spread

    for entry in data["cells"]:  # every run's values in the JSON; the Markdown cell is recomputed from them
        if entry["status"] != "ok":
            continue
        assert [r["run"] for r in entry["runs"]] == [1, 2]
        assert all(len(r["decode_token_s"]) == cfg.decode_length - 1 for r in entry["runs"])
        row = tput[str(entry["batch"])]
        assert row[1] == "2" and row[2] == fmt_spread([r["prefill_requests_per_s"] for r in entry["runs"]])
        assert row[3] == fmt_spread([r["prefill_tokens_per_s"] for r in entry["runs"]])
        assert row[4] == fmt_spread([r["decode_tokens_per_s"] for r in entry["runs"]])
    statuses = {c["batch"]: c["status"] for c in data["cells"]}
    assert statuses == {1: "ok", 2: "ok", 8: "skipped"}
    png = tmp_path / "out" / "latency.png"
    assert png in paths and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_engine_that_cannot_start_explains_every_cell(tiny_model: str, tmp_path: Path) -> None:
    # 300 + 8 tokens exceed the tiny model's 256 positions: the engine refuses to start, every cell says so.
    cfg = LatencyBenchConfig(
        model=tiny_model, batch_size=(1, 2), sequence_length=300, decode_length=8, runs=1, out_dir=tmp_path, plots=False
    )
    result = run_latency_bench(cfg)
    assert all(not c.ok and "exceeds the model's limit of 256" in (c.reason or "") for c in result.cells)
    md = render_markdown(result, ["bench", "latency"])
    assert_no_blank_or_nan(md)
    # Checked against the model in the first stage, before any weights are read (engine/config_check.py).
    assert "n/a (start-up failed in model_prepare" in md


def test_single_run_cells_say_n1_and_plot_renders(tmp_path: Path) -> None:
    """One run: the Average cell carries its value and n=1, every spread cell says n=1 (never a fake distribution)."""
    from glowplug.profiling.bench.latency import LatencyCell, LatencyResult

    cfg = LatencyBenchConfig(batch_size=(1, 4), runs=1, sequence_length=16, decode_length=3, out_dir=tmp_path)
    cells = [
        LatencyCell(
            "none",
            1,
            prefill_s=[0.010],
            decode_token_s=[0.002, 0.003],
            decode_total_s=[0.005],
            prefill_tokens_per_s=[1600.0],
            decode_tokens_per_s=[400.0],
            prefill_steps=1,
            prefill_requests_per_s=[100.0],
        ),
        LatencyCell("none", 4, reason="KV cache: needs 8 blocks, has 4"),
    ]
    result = LatencyResult(cfg, cells, {"none": 4}, {"none": ("bfloat16", "off")})
    md = render_markdown(result, ["bench", "latency"])
    assert_no_blank_or_nan(md)
    assert "Latency (dtype bfloat16, compile off, sequence length 16, decode length 3)" in md
    prefill = next(r for r in markdown_cells(md) if r[:2] == ["Prefill", "1"] and len(r) == 9)
    assert prefill[2:] == ["1", "10.00 ms (n=1)", "n=1", "n=1", "n=1", "n=1", "n=1"]
    token = next(r for r in markdown_cells(md) if r[:2] == ["Decode (token)", "1"])
    assert token[2:5] == ["2", "2.50 ms", "2.00 ms"]  # two step samples: a real spread
    assert "| 1 | 1 | 100.00 (n=1) | 1,600.00 (n=1) | 400.00 (n=1) |" in md
    assert "± 0" not in md
    paths = write_reports(result)
    assert (tmp_path / "latency.png") in paths


def test_latency_per_tensor_parallel_size(tiny_model: str, tmp_path: Path) -> None:
    """Seed 001's layout once per TP size (TGI measured --num-shard 1, 2, 4, 8): both engines really run."""
    cfg = LatencyBenchConfig(
        model=tiny_model,
        batch_size=(1, 2),
        sequence_length=16,
        decode_length=3,
        runs=1,
        warmups=0,
        dtype="float32",
        tensor_parallel_size=(1, 2),
        num_gpu_blocks_override=16,
        out_dir=tmp_path / "out",
        plots=False,
    )
    result = run_latency_bench(cfg)
    assert {(c.tensor_parallel_size, c.batch) for c in result.cells if c.ok} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert result.resolved["none, TP 2"][1] == "off"  # tensor parallel runs the decode step eagerly
    md = render_markdown(result, ["bench", "latency"])
    assert_no_blank_or_nan(md)
    assert "## Tensor parallel 1 · " in md and "## Tensor parallel 2 · " in md
    assert len(re.findall(r"Latency \(tensor parallel [12], dtype float32, compile (on|off), sequence", md)) == 2
    assert "| Tensor Parallel | 1, 2 |" in md
    rows = [r for r in markdown_cells(md) if r[0] in ("Prefill", "Decode (token)", "Decode (total)") and len(r) == 9]
    assert len(rows) == 12  # 3 steps x 2 batch sizes x 2 TP sizes


def test_seed_001_columns_on_a_hand_made_timing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Batch 4 x 1024 prompt tokens prefilled in 0.5 s, 8 new tokens, 7 decode steps in 0.7 s: seed 001's
    Prefill = 4 / 0.5 = 8 requests/s (TGI's "tokens/secs"), glowplug's = 4 x 1024 / 0.5 = 8,192 prompt tokens/s,
    Decode = 4 x 7 / 0.7 = 40 tokens/s (TGI's batch x (decode length - 1) / decode total)."""
    from glowplug.profiling.bench import latency, timing
    from glowplug.profiling.bench.latency import LatencyCell, LatencyResult

    fake = timing.BatchTiming(
        batch=4,
        prompt_tokens=4 * 1024,
        generated_tokens=4 * 8,
        prefill_s=0.5,
        decode_s=0.7,
        prefill_steps=1,
        decode_step_s=(0.1,) * 7,
    )
    monkeypatch.setattr(timing, "time_batch", lambda *_args: fake)
    cfg = LatencyBenchConfig(batch_size=(4,), runs=3, warmups=1, out_dir=tmp_path)
    assert (cfg.sequence_length, cfg.decode_length, cfg.runs, cfg.warmups) == (1024, 8, 3, 1)
    assert LatencyBenchConfig().batch_size == (1, 2, 4, 8, 16, 32) and LatencyBenchConfig().runs == 10
    cell = LatencyCell("none", 4)
    latency._measure(None, cfg, cell, [], None)
    assert cell.prefill_requests_per_s == pytest.approx([8.0] * 3)
    assert cell.prefill_tokens_per_s == pytest.approx([8192.0] * 3)
    assert cell.decode_tokens_per_s == pytest.approx([40.0] * 3)
    md = render_markdown(LatencyResult(cfg, [cell], {"none": 100}, {"none": ("bfloat16", "on")}))
    assert "| 4 | 3 | 8.00 (8.00–8.00) | 8,192.00 (8,192.00–8,192.00) | 40.00 (40.00–40.00) |" in md
    paths = write_reports(LatencyResult(cfg, [cell], {"none": 100}, {"none": ("bfloat16", "on")}))
    assert (tmp_path / "latency.png") in paths
