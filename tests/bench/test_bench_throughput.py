"""`bench throughput` on the tiny model: unique runs, real input throughput, clipping notes, reasons, ranking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_no_blank_or_nan

from glowplug.profiling.bench import timing
from glowplug.profiling.bench.throughput import (
    ThroughputBenchConfig,
    RunRecord,
    Shape,
    mean_pm,
    ranking,
    render_markdown,
    resolve_shapes,
    run_throughput_bench,
    summarize_runs,
    write_reports,
)


def test_resolve_shapes_clips_to_the_model_limit() -> None:
    shapes = {s.name: s for s in resolve_shapes(("interactive", "long_context"), 8192)}
    assert (shapes["interactive"].input_len, shapes["interactive"].note) == (128, None)
    lc = shapes["long_context"]
    assert (lc.batch, lc.input_len, lc.output_len) == (1, 8160, 32)
    assert lc.note == "input clipped from 16384 to 8160 tokens: the model allows 8192 positions"
    assert resolve_shapes(("decode_bound",), 300)[0].impossible is not None  # 512 output tokens never fit


def test_throughput_runs(tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_build = timing.build_llm

    def build(fields: dict[str, Any]) -> tuple[Any, str | None]:
        if fields["quantization"] == "int4":  # stands in for a scheme that is not wired yet
            return None, "start-up failed in quantize_weights: NotImplementedError: int4 is not wired"
        return real_build(fields)

    monkeypatch.setattr(timing, "build_llm", build)
    cfg = ThroughputBenchConfig(
        model=tiny_model,
        quantization=("none", "int4"),
        configs=("interactive", "long_context", "high_concurrency"),
        runs=2,
        num_gpu_blocks_override=200,  # high_concurrency: 64 x 16 blocks do not fit
        out_dir=tmp_path,
    )
    shapes, records = run_throughput_bench(cfg)
    lines = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [ln["run_id"] for ln in lines] == [r.run_id for r in records]
    assert len({ln["run_id"] for ln in lines}) == len(lines)  # seed 002 listed a run twice
    ok = [ln for ln in lines if ln["status"] == "ok"]
    assert sorted(ln["run_id"] for ln in ok) == sorted(
        f"none_{c}_run{i}" for c in ("interactive", "long_context") for i in (1, 2)
    )
    for ln in ok:
        assert ln["input_throughput"] > 0  # seed 002 printed 0.00 everywhere
        assert ln["input_throughput"] == pytest.approx(ln["prompt_tokens"] / ln["prefill_s"])
        assert ln["generated_tokens"] == ln["batch_size"] * ln["output_len"]
        assert ln["latency_s"] == pytest.approx(ln["prefill_s"] + ln["decode_s"])
        assert ln["overall_throughput"] > ln["e2e_output_throughput"] > 0
        # seed 002's Output Throughput: output tokens over the decode time only (prefill excluded)
        assert ln["output_throughput"] == pytest.approx(ln["generated_tokens"] / ln["decode_s"])
        assert ln["output_throughput"] > ln["e2e_output_throughput"]
        assert ln["dtype"] and ln["compile"] in ("on", "off")
    skipped = {ln["run_id"]: ln["reason"] for ln in lines if ln["status"] == "skipped"}
    assert skipped["none_high_concurrency"] == "KV cache: needs 1024 blocks, has 200"
    assert all("int4 is not wired" in skipped[f"int4_{c}"] for c in ("interactive", "long_context", "high_concurrency"))
    lc = next(s for s in shapes if s.name == "long_context")
    assert lc.input_len == 256 - 32 and "clipped from 16384" in (lc.note or "")

    summaries = summarize_runs(shapes, records, cfg.quantization)
    ranked = ranking(summaries, "interactive")
    assert [s.quantization for s in ranked] == ["none"]  # a scheme that never ran is not ranked
    md = render_markdown(cfg, shapes, records, ["bench", "throughput"])
    assert_no_blank_or_nan(md)
    assert "> Note: input clipped from 16384 to 224 tokens" in md
    assert "n/a (start-up failed in quantize_weights" in md
    assert "## Ranking by output throughput" in md and "1. **none**" in md
    paths = write_reports(cfg, shapes, records, ["bench", "throughput"])
    assert (tmp_path / "ranking.png") in paths and (tmp_path / "summary.md").is_file()


def _synthetic(quant: str, i: int, prefill_s: float, decode_s: float, dtype: str = "bfloat16") -> RunRecord:
    from glowplug.profiling.bench.throughput import _record
    from glowplug.profiling.bench.timing import BatchTiming

    t = BatchTiming(batch=1, prompt_tokens=2048, generated_tokens=32, prefill_s=prefill_s, decode_s=decode_s,
                    prefill_steps=1, decode_step_s=())  # fmt: skip
    return _record(quant, Shape("prefill_bound", 1, 2048, 32), i, t, dtype, "off")


def test_seed_002_output_throughput_excludes_prefill() -> None:
    """Seed 002 divides the output tokens by the decode time: 32 tokens, 4 s prefill + 2 s decode -> 16 tok/s, not
    32 / 6 s (glowplug's end-to-end figure, kept as its own column)."""
    r = _synthetic("none", 1, prefill_s=4.0, decode_s=2.0)
    assert r.output_throughput == pytest.approx(16.0)
    assert r.e2e_output_throughput == pytest.approx(32 / 6.0)
    assert r.input_throughput == pytest.approx(2048 / 4.0)
    assert r.overall_throughput == pytest.approx((2048 + 32) / 6.0)
    assert _synthetic("none", 1, prefill_s=4.0, decode_s=0.0).output_throughput is None  # no decode phase


def test_single_run_is_marked_n1_never_pm_zero() -> None:
    assert mean_pm((5.0, 0.0), 1) == "5.00 (n=1)"
    assert mean_pm((5.0, 0.25), 3) == "5.00 ± 0.25"
    shapes = [Shape("prefill_bound", 1, 2048, 32)]
    records = [_synthetic("none", 1, 4.0, 2.0), _synthetic("int8", 1, 3.0, 1.0),
               _synthetic("int4", 1, 3.0, 1.0, dtype="float32")]  # fmt: skip
    cfg = ThroughputBenchConfig(quantization=("none", "int8", "int4"), configs=("prefill_bound",), runs=1)
    md = render_markdown(cfg, shapes, records, ["bench", "throughput"])
    assert "± 0.00" not in md and "16.00 (n=1)" in md
    assert "| `none` | bfloat16 | off | 1 |" in md
    assert "Output Throughput (seed 002's definition): output tokens / decode time, prefill excluded" in md
    assert "glowplug E2E Output Throughput (tok/s)" in md
    # quantization is compared with none at the same dtype and compile mode, never across dtypes
    assert "**int8** (bfloat16, compile off): 32.00 (n=1) tok/s (2.00x vs none at bfloat16, compile off)" in md
    assert "**int4** (float32, compile off): 32.00 (n=1) tok/s (no `none` run at float32, compile off" in md
