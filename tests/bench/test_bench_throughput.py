"""`bench throughput` on the tiny model: unique runs, real input throughput, clipping notes, reasons, ranking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_no_blank_or_nan, markdown_cells

from glowplug.profiling.bench import timing
from glowplug.profiling.bench.throughput import (
    NAMED_CONFIGS,
    RunRecord,
    Shape,
    ThroughputBenchConfig,
    paired_ratios,
    ranking,
    ranking_plot_groups,
    render_markdown,
    resolve_shapes,
    run_throughput_bench,
    summarize_runs,
    write_reports,
)
from glowplug.profiling.bench.timing import BatchTiming


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
    partial = json.loads((tmp_path / "summary.json").read_text())  # rewritten as runs finish
    assert partial["partial"] is True
    lines = partial["runs"]
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
        # Output Throughput: tokens after each sequence's first over the time after the first tokens
        assert ln["decode_tokens"] == ln["batch_size"] * (ln["output_len"] - 1)
        assert ln["output_throughput"] == pytest.approx(ln["decode_tokens"] / ln["decode_s"])
        # The end-to-end column counts every token over the whole latency
        assert ln["e2e_output_throughput"] == pytest.approx(ln["generated_tokens"] / ln["latency_s"])
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
    # One JSON beside the Markdown, holding every run's values
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["ranking.png", "summary.json", "summary.md"]
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["partial"] is False and [r["run_id"] for r in data["runs"]] == [r.run_id for r in records]


def _synthetic(
    quant: str, i: int, prefill_s: float, decode_s: float, dtype: str = "bfloat16", config: str = "prefill_bound"
) -> RunRecord:
    from glowplug.profiling.bench.throughput import _record

    t = BatchTiming(
        batch=1,
        prompt_tokens=2048,
        generated_tokens=32,
        prefill_s=prefill_s,
        decode_s=decode_s,
        prefill_steps=1,
        decode_step_s=(),
    )
    return _record(quant, Shape(config, 1, 2048, 32), i, t, dtype, "off")


def test_output_throughput_counts_only_tokens_after_the_first() -> None:
    """One definition: tokens after each sequence's first / time after the first tokens. 32 tokens, 4 s prefill +
    2 s decode -> 31 / 2 = 15.5 tok/s (counting the first token over the decode time, 16 tok/s, inflated it by
    32/31); the end-to-end figure stays its own column."""
    r = _synthetic("none", 1, prefill_s=4.0, decode_s=2.0)
    assert r.decode_tokens == 31
    assert r.output_throughput == pytest.approx(15.5)
    assert r.e2e_output_throughput == pytest.approx(32 / 6.0)
    assert r.input_throughput == pytest.approx(2048 / 4.0)
    assert r.overall_throughput == pytest.approx((2048 + 32) / 6.0)
    assert _synthetic("none", 1, prefill_s=4.0, decode_s=0.0).output_throughput is None  # no decode phase


def test_batch_timing_definitions_on_a_hand_made_batch() -> None:
    """Batch 4 x 8 new tokens, 7 decode steps of 0.2 s: 4 x 7 = 28 tokens in 1.4 s = 20 tok/s, never 32 / 1.4."""
    t = BatchTiming(
        batch=4,
        prompt_tokens=4 * 1024,
        generated_tokens=32,
        prefill_s=0.5,
        decode_s=1.4,
        prefill_steps=1,
        decode_step_s=(0.2,) * 7,
    )
    assert t.decode_tokens == 28
    assert t.output_tokens_per_s == pytest.approx(20.0)
    assert t.prefill_requests_per_s == pytest.approx(8.0)  # seed 001: batch / prefill
    assert t.prefill_tokens_per_s == pytest.approx(8192.0)  # glowplug: batch x 1024 / prefill
    one = BatchTiming(
        batch=2, prompt_tokens=8, generated_tokens=2, prefill_s=0.1, decode_s=0.0, prefill_steps=1, decode_step_s=()
    )
    assert one.output_tokens_per_s is None


def test_single_run_is_marked_n1_and_ratios_are_paired(tmp_path: Path) -> None:
    shapes = [Shape("prefill_bound", 1, 2048, 32)]
    records = [
        _synthetic("none", 1, 4.0, 2.0),
        _synthetic("int8", 1, 3.0, 1.0),
        _synthetic("int4", 1, 3.0, 1.0, dtype="float32"),
    ]
    cfg = ThroughputBenchConfig(quantization=("none", "int8", "int4"), configs=("prefill_bound",), runs=1)
    md = render_markdown(cfg, shapes, records, ["bench", "throughput"])
    assert "± 0.00" not in md and "15.50 (n=1)" in md
    assert "| `none` | bfloat16 | off | 1 |" in md
    assert "Output Throughput: tokens after each sequence's first token / time after the first tokens" in md
    assert "glowplug E2E Output Throughput (tok/s)" in md
    # quantization is compared with none at the same dtype and compile mode, never across dtypes
    assert "1. **int8** (bfloat16, compile off): 31.00 (n=1) tok/s, n=1 (2.00x vs none, worst pair 2.00x, 1 pairs" in md
    assert "**int4** (float32, compile off): 31.00 (n=1) tok/s, n=1 (no `none` run at float32, compile off" in md


def test_paired_ratios_take_run_i_over_run_i() -> None:
    # none: 15.5, 31.0, 10.33 tok/s; int8: 31.0 each -> pairs 2.0, 1.0, 3.0 (not the ratio of the medians)
    records = [
        _synthetic("none", 1, 1.0, 2.0),
        _synthetic("none", 2, 1.0, 1.0),
        _synthetic("none", 3, 1.0, 3.0),
        *(_synthetic("int8", i, 1.0, 1.0) for i in (1, 2, 3)),
    ]
    assert paired_ratios(records, "prefill_bound", "int8") == pytest.approx([2.0, 1.0, 3.0])
    cfg = ThroughputBenchConfig(quantization=("none", "int8"), configs=("prefill_bound",), runs=3)
    md = render_markdown(cfg, [Shape("prefill_bound", 1, 2048, 32)], records, None)
    assert "(2.00x vs none, worst pair 1.00x, 3 pairs" in md
    assert "15.50 (10.33–31.00)" in md  # none's median (min–max)


def _accuracy(tmp_path: Path) -> Path:
    path = tmp_path / "accuracy.json"
    path.write_text(
        json.dumps({"reference_perplexity": 10.0, "perplexity": {"none": 10.0, "int8": 10.4, "int2": 4.55e7}})
    )
    return path


def test_unusable_scheme_is_flagged_in_the_ranking_and_its_plot(tmp_path: Path) -> None:
    """int2 is the fastest here but has 4.55e6x bf16's perplexity: it is drawn hatched with its label, and listed
    after the usable schemes, not ranked first."""
    records = [
        _synthetic(q, i, 1.0, d, config="interactive")
        for q, d in (("none", 2.0), ("int8", 1.0), ("int2", 0.5))
        for i in (1, 2, 3)
    ]
    shapes = [Shape("interactive", 1, 2048, 32)]
    cfg = ThroughputBenchConfig(
        quantization=("none", "int8", "int2"),
        configs=("interactive",),
        runs=3,
        quality_from=_accuracy(tmp_path),
        out_dir=tmp_path / "out",
    )
    summaries = summarize_runs(shapes, records, cfg.quantization)
    from glowplug.profiling.bench.quality import load_flags

    flags = load_flags(cfg.quality_from)
    assert [s.quantization for s in ranking(summaries, "interactive", flags)] == ["int8", "none", "int2"]
    bars = ranking_plot_groups(shapes, summaries, flags)["interactive (batch_size=1, input_len=2048, output_len=32)"]
    assert [(b[0], b[4]) for b in bars] == [
        ("int8 (n=3)", None),
        ("none (n=3)", None),
        ("int2 (n=3)", "unusable: perplexity > 2x bf16"),
    ]
    assert bars[2][1] == pytest.approx(62.0)  # median 31 tokens / 0.5 s
    md = render_markdown(cfg, shapes, records, None)
    assert "1. **int8**" in md and "2. **none**" in md and "- not ranked: **int2**" in md
    paths = write_reports(cfg, shapes, records, None)
    assert (tmp_path / "out" / "ranking.png") in paths


def test_config_table_lists_all_seven_configurations() -> None:
    from glowplug.profiling.bench.all import BenchAllConfig, plan_steps

    assert len(NAMED_CONFIGS) == 7
    # The full `bench all` run asks for all seven of seed 002's configurations.
    argv = plan_steps(BenchAllConfig(), ["throughput"])[0].argv
    assert set(argv[argv.index("--configs") + 1].split(",")) == set(NAMED_CONFIGS)
    shapes = resolve_shapes(("interactive",), 8192)
    md = render_markdown(
        ThroughputBenchConfig(configs=("interactive",), runs=1),
        shapes,
        [_synthetic("none", 1, 1.0, 1.0, config="interactive")],
        None,
    )
    assert_no_blank_or_nan(md)
    rows = {r[0]: r for r in markdown_cells(md) if len(r) == 5 and r[0].startswith("`")}
    assert set(rows) == {f"`{n}`" for n in NAMED_CONFIGS}
    assert rows["`base`"][1:4] == ["32", "256", "32"] and rows["`high_concurrency`"][1:4] == ["64", "256", "128"]
    assert rows["`base`"][4] == "n/a (not in --configs: not run)"
    assert rows["`interactive`"][4] == "1 scheme(s) x 1 run(s)"


def test_skip_unusable_says_why_in_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--skip-unusable: the flagged scheme starts no engine and its rows carry the reason (no engine is built)."""
    built: list[str] = []

    def build(fields: dict[str, Any]) -> tuple[Any, str | None]:
        built.append(fields["quantization"])
        return None, "stand-in: no engine in this test"

    monkeypatch.setattr(timing, "build_llm", build)
    monkeypatch.setattr(timing, "model_position_limit", lambda *_a, **_k: 8192)
    cfg = ThroughputBenchConfig(
        quantization=("none", "int2"),
        configs=("interactive", "base"),
        runs=3,
        quality_from=_accuracy(tmp_path),
        skip_unusable=True,
        out_dir=tmp_path / "o",
    )
    shapes, records = run_throughput_bench(cfg)
    assert built == ["none"]
    reasons = {r.run_id: r.reason for r in records if r.quantization == "int2"}
    assert set(reasons) == {"int2_interactive", "int2_base"}
    assert all(
        r and r.startswith("not timed (--skip-unusable): unusable: perplexity 4.55e+07") for r in reasons.values()
    )
    md = render_markdown(cfg, shapes, records, None)
    assert_no_blank_or_nan(md)
    assert "n/a (not timed (--skip-unusable): unusable: perplexity 4.55e+07" in md
    assert "- not ranked: **int2**: n/a (not timed (--skip-unusable): unusable: perplexity 4.55e+07" in md
