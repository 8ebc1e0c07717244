"""The decode report's rendering (no engine): seed 003's model_size column, units in headers, n=1 cells."""

from __future__ import annotations

from conftest import assert_no_blank_or_nan, markdown_cells

from glowplug.profiling.bench.decode import DecodeBenchConfig, DecodeRow, render_markdown


def _row(quant: str, runs: int) -> DecodeRow:
    row = DecodeRow("glowplug", "off", "bfloat16", quant, 1, [], [], [], 80.0 if quant == "none" else 25.0)
    for i in range(runs):
        row.tokens_per_s.append(100.0 + i)
        row.step_ms.append(10.0 - i * 0.1)
        row.probe_gbps.append(20.0)
        row.prefill_ms.append(5.0)
        row.peak_gb.append(1.0)
        row.host_ms.append(0.5 + i * 0.1)
    return row


def test_decode_table_has_model_size_and_percent_of_probe_without_unit_in_cells() -> None:
    rows = [_row("none", 3), _row("int4", 1)]
    text = render_markdown(rows, DecodeBenchConfig(compare_hf=False), None)
    assert_no_blank_or_nan(text)
    table = [r for r in markdown_cells(text) if r[0] in ("engine", "glowplug")]
    head = table[0]
    by_name = {name: [r[i] for r in table[1:]] for i, name in enumerate(head)}
    assert by_name["model_size MB"] == ["80.0", "25.0"]
    # bf16: 80 MB per token at 10 ms per step (median of 10.0, 9.9, 9.8 ms = 9.9 ms) -> 8.1 GB/s = 40 % of 20 GB/s
    assert by_name["GB/s"][0].startswith("8.1 (")
    assert by_name["% of probe"][0].startswith("40.4 (")
    single = by_name["% of probe"][1]
    assert single.endswith("(n=1)") and "%" not in single  # never "0 (n=1)%"
    assert "± 0" not in text


def test_decode_table_has_host_ms_next_to_ms_per_step() -> None:
    rows = [_row("none", 3)]
    text = render_markdown(rows, DecodeBenchConfig(compare_hf=False), None)
    assert_no_blank_or_nan(text)
    table = [r for r in markdown_cells(text) if r[0] in ("engine", "glowplug")]
    head = table[0]
    assert head.index("host ms / step") == head.index("ms / step") + 1
    by_name = {name: [r[i] for r in table[1:]] for i, name in enumerate(head)}
    assert by_name["host ms / step"] == ["0.600 (0.500–0.700)"]  # median (min-max) of the runs' medians
    assert "host ms / step:" in text  # defined under the table


def test_long_context_rows_pair_their_extra_time_with_the_kv_bytes_read() -> None:
    """A 2,048-token row against the same configuration at 64 tokens: the extra ms per step run by run, and the
    extra KV bytes over that time as a share of each run's probe; a cell the KV cache cannot hold is listed."""
    short, long_ = _row("none", 3), _row("none", 3)
    short.context, long_.context = 64, 2048
    short.kv_mb, long_.kv_mb = 1.5, 43.5  # 42 MB more per step
    long_.step_ms = [s + 3.0 for s in short.step_ms]  # 3 ms more each run: 14 GB/s = 70 % of 20 GB/s
    left = DecodeRow(
        "glowplug",
        "off",
        "bfloat16",
        "none",
        64,
        [],
        [],
        [],
        None,
        context=8192,
        skipped="needs 532480 KV tokens, the cache holds 93200",
    )
    text = render_markdown(
        [short, long_, left], DecodeBenchConfig(compare_hf=False, prompt_tokens=(64, 2048, 8192)), None
    )
    assert_no_blank_or_nan(text)
    table = [r for r in markdown_cells(text) if r[0] in ("engine", "glowplug")]
    by_name = {name: [r[i] for r in table[1:]] for i, name in enumerate(table[0])}
    assert by_name["context"] == ["64", "2048"]
    assert by_name["extra ms over the shortest context"] == ["-", "3.00 (3.00–3.00)"]
    assert by_name["KV read at % of probe"] == ["-", "70.0 (70.0–70.0)"]
    assert "batch 64, context 8192: needs 532480 KV tokens, the cache holds 93200" in text


def test_a_max_model_len_shorter_than_the_runs_is_refused_with_the_length_needed() -> None:
    import pytest
    from pydantic import ValidationError

    with pytest.raises(
        ValidationError,
        match=r"64 is shorter than the longest prompt \+ new tokens \(192\); pass at "
        r"least 192",
    ):
        DecodeBenchConfig(max_model_len=(64, 8192), prompt_tokens=(64,), new_tokens=128)
    assert DecodeBenchConfig(max_model_len=(512, 8192), prompt_tokens=(64,), new_tokens=128).max_model_len == (
        512,
        8192,
    )


def test_the_long_context_target_gets_a_verdict_on_its_worst_run() -> None:
    """Issue 52: the 70% KV-read target at 2,048 tokens says PASS or FAIL on its worst run, in the report and for
    `bench all` (decode_verdicts is what `bench decode --out` leaves beside the report)."""
    from glowplug.profiling.bench.decode import decode_verdicts

    short, long_ = _row("none", 3), _row("none", 3)
    short.context, long_.context = 64, 2048
    short.kv_mb, long_.kv_mb = 1.5, 43.5
    long_.step_ms = [s + d for s, d in zip(short.step_ms, (3.0, 3.0, 4.0))]  # the third run: 52.5% of the probe
    (verdict,) = decode_verdicts([short, long_])
    assert verdict.passed is False and verdict.measured == "worst run 52.5%" and "2048 tokens" in verdict.target
    text = render_markdown([short, long_], DecodeBenchConfig(compare_hf=False, prompt_tokens=(64, 2048)), None)
    assert "## Verdicts" in text and "**FAIL**" in text.split("## Verdicts")[1]
    long_.step_ms = [s + 3.0 for s in short.step_ms]
    assert decode_verdicts([short, long_])[0].passed is True
