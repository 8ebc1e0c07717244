"""`glowplug bench latency`: prefill and decode latency per batch size, in the layout of TGI's
`text-generation-benchmark`, with its bugs fixed.

Per batch size: `--warmups` untimed batches, then `--runs` timed ones (see `timing.time_batch`). Rows:
  Prefill         one sample per run: requests added -> every sequence has its first token. The step token budget
                  defaults to batch x sequence length, so the whole batch is prefilled in one forward, as in TGI.
  Decode (token)  one sample per decode step, over all runs (decode-length - 1 steps a run).
  Decode (total)  one sample per run: the sum of that run's decode steps.
Throughput table, one sample per run each, median (min-max) over the runs:
  Prefill (requests/s)       TGI's "Prefill" row, under its definition: batch / prefill time (TGI labels it
                             tokens/secs; it is sequences prefilled, i.e. first tokens, per second)
  Prefill (prompt tokens/s)  glowplug's: batch x sequence length / prefill time (= requests/s x sequence length)
  Decode (tokens/s)          TGI's and glowplug's (`BatchTiming.output_tokens_per_s`): batch x (decode length
                             - 1) / Decode (total)
The defaults are TGI's reference grid (sequence length 1024, decode length 8, 10 runs, 1 warm-up, batch 1-32).
Percentiles use the one method of `stats.py`. A batch size that cannot run (KV cache too small, an engine that does
not start) gets the reason in every cell, never NaN or blank. The JSON lists every run's values.
Prefix caching is off: every run sends the same prompts, and a cache hit would time a prefill that never ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from glowplug.engine.config import Quantization

from .cli_support import (
    AddModelFlags,
    BenchEngineFields,
    add_command,
    prepare_out_dir,
    quantization_label,
    write_json,
)
from .stats import PERCENTILE_METHOD, Summary, summarize
from .tables import Cell, Missing, fmt_num, fmt_spread, markdown_table

Progress = Callable[[str], None]


class LatencyBenchConfig(BenchEngineFields):
    quantization: tuple[Quantization, ...] = Field(("none",), min_length=1, description="Schemes to compare.")
    batch_size: tuple[int, ...] = Field((1, 2, 4, 8, 16, 32), min_length=1, description="Batch sizes.")
    tensor_parallel_size: tuple[int, ...] = Field(
        (1,),
        min_length=1,
        description="Tensor-parallel sizes to compare (one engine per size and scheme, as TGI's "
        "reference run measures --num-shard 1, 2, 4 and 8).",
    )
    # TGI's text-generation-benchmark grid by default: 1024 / 8 / 10 runs / 1 warm-up.
    sequence_length: int = Field(1024, ge=1, description="Prompt tokens per sequence (TGI's grid: 1024).")
    decode_length: int = Field(
        8, ge=2, description="New tokens per sequence, the first from the prefill (TGI's grid: 8)."
    )
    runs: int = Field(10, ge=1, description="Timed batches per batch size (TGI's grid: 10).")
    warmups: int = Field(1, ge=0, description="Untimed batches before them (TGI's grid: 1).")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 disables.")
    repetition_penalty: float = Field(1.0, gt=0.0)
    # Under the working directory, named after the command: never the checkout's reports/ unless asked.
    out_dir: Path = Field(Path("latency"), description="Where latency.md/.json/.png go.")
    plots: bool = True

    @model_validator(mode="after")
    def _distinct(self) -> LatencyBenchConfig:
        for name in ("quantization", "batch_size", "tensor_parallel_size"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"--{name.replace('_', '-')} lists a value twice: {list(values)}")
        if any(b < 1 for b in self.batch_size):
            raise ValueError("batch sizes must be >= 1")
        if any(n < 1 for n in self.tensor_parallel_size):
            raise ValueError("tensor-parallel sizes must be >= 1")
        return self


@dataclass
class LatencyCell:
    """One (quantization, batch size): the samples, or the reason there are none."""

    quantization: str
    batch: int
    reason: str | None = None
    tensor_parallel_size: int = 1
    prefill_s: list[float] = field(default_factory=list)
    decode_token_s: list[float] = field(default_factory=list)
    decode_total_s: list[float] = field(default_factory=list)
    prefill_tokens_per_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)
    prefill_steps: int = 0
    prefill_requests_per_s: list[float] = field(default_factory=list)  # seed 001's prefill row: batch / prefill

    @property
    def ok(self) -> bool:
        return self.reason is None

    def runs_decode_steps(self) -> int:
        """Decode steps per run (every run has the same number: exactly decode length tokens each)."""
        return len(self.decode_token_s) // len(self.prefill_s) if self.prefill_s else 0


@dataclass
class LatencyResult:
    config: LatencyBenchConfig
    cells: list[LatencyCell]
    kv_blocks: dict[str, int] = field(default_factory=dict)  # per quantization that started
    # What each started engine resolved `--dtype auto` / `--compile auto` to: the tables state these, not the flags.
    resolved: dict[str, tuple[str, str]] = field(default_factory=dict)  # quantization -> (dtype, "on" | "off")

    def setting(self, quant: str) -> str:
        """ "dtype bfloat16, compile off" for a quantization that started; the requested flags otherwise."""
        if quant in self.resolved:
            dtype, mode = self.resolved[quant]
            return f"dtype {dtype}, compile {mode}"
        return f"dtype {self.config.dtype} (requested), compile {self.config.compile} (requested; engine did not start)"


def _sampling(cfg: LatencyBenchConfig) -> Any:
    from glowplug.engine.sampling_params import SamplingParams

    return SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        repetition_penalty=cfg.repetition_penalty,
        max_tokens=cfg.decode_length,
        ignore_eos=True,  # every run must generate exactly decode_length tokens, or runs are not comparable
    )


def run_label(cfg: LatencyBenchConfig, quant: str, tp: int) -> str:
    """How the report names one engine: its scheme, and its TP size when more than TP=1 is measured."""
    return quant if cfg.tensor_parallel_size == (1,) else f"{quant}, TP {tp}"


def engine_fields(cfg: LatencyBenchConfig, quant: str, tp: int = 1) -> dict[str, Any]:
    largest = max(cfg.batch_size)
    return cfg.engine_fields(
        quantization=quant,
        **({"tensor_parallel_size": tp} if tp > 1 else {}),
        max_model_len=cfg.sequence_length + cfg.decode_length,
        max_num_seqs=largest,
        max_num_batched_tokens=cfg.max_num_batched_tokens or max(16, largest * cfg.sequence_length),
        enable_prefix_caching=False,
    )


def _measure(engine: Any, cfg: LatencyBenchConfig, cell: LatencyCell, prompts: list[list[int]], params: Any) -> None:
    from .timing import time_batch

    for _ in range(cfg.warmups):
        time_batch(engine, prompts, params)
    for _ in range(cfg.runs):
        t = time_batch(engine, prompts, params)
        if t.generated_tokens != cell.batch * cfg.decode_length:
            raise RuntimeError(f"generated {t.generated_tokens} tokens, expected {cell.batch * cfg.decode_length}")
        cell.prefill_s.append(t.prefill_s)
        cell.decode_token_s.extend(t.decode_step_s)
        cell.decode_total_s.append(t.decode_s)
        decode_rate = t.output_tokens_per_s
        if decode_rate is None:  # decode_length >= 2 guarantees a decode phase; a zero-length clock is a bug
            raise RuntimeError("a run had no measurable decode phase")
        cell.prefill_requests_per_s.append(t.prefill_requests_per_s)
        cell.prefill_tokens_per_s.append(t.prefill_tokens_per_s)
        cell.decode_tokens_per_s.append(decode_rate)
        cell.prefill_steps = t.prefill_steps


def run_latency_bench(cfg: LatencyBenchConfig, progress: Progress | None = None) -> LatencyResult:
    import gc

    from glowplug.base.errors import one_line

    from .decode import make_prompts
    from .timing import build_llm, why_cannot_run

    say = progress or (lambda _msg: None)
    result = LatencyResult(cfg, [])
    params = _sampling(cfg)
    runs = [(tp, quant) for tp in cfg.tensor_parallel_size for quant in cfg.quantization]
    for tp, quant in runs:
        label = run_label(cfg, quant, tp)
        say(f"[{label}] starting the engine")
        llm, why = build_llm(engine_fields(cfg, quant, tp))
        if llm is None:
            result.cells += [LatencyCell(quant, b, reason=why, tensor_parallel_size=tp) for b in cfg.batch_size]
            continue
        result.kv_blocks[label] = llm.engine.stats().kv_blocks
        result.resolved[label] = (
            str(llm.startup.dtype).removeprefix("torch."),
            "on" if llm.engine.compiled else "off",
        )
        for batch in cfg.batch_size:
            why_not = why_cannot_run(llm.engine, batch, cfg.sequence_length, cfg.decode_length)
            cell = LatencyCell(quant, batch, reason=why_not, tensor_parallel_size=tp)
            result.cells.append(cell)
            if not cell.ok:
                say(f"[{label}] batch {batch}: skipped ({cell.reason})")
                continue
            say(f"[{label}] batch {batch}: {cfg.warmups} warm-up + {cfg.runs} runs")
            prompts = make_prompts(llm.tokenizer, batch, cfg.sequence_length)
            try:
                _measure(llm.engine, cfg, cell, prompts, params)
            except Exception as exc:  # a scheme still being wired may fail mid-run: the cell says how
                cell.reason = f"failed: {one_line(exc)}"
                for req_id in llm.engine.request_ids():
                    llm.engine.abort(req_id)
        if llm.startup.parallel is not None:
            llm.startup.parallel.close()  # the next size starts its own ranks
        llm = None
        gc.collect()
    return result


# ---------------------------------------------------------------- rendering

LATENCY_ROWS = (("Prefill", "prefill_s"), ("Decode (token)", "decode_token_s"), ("Decode (total)", "decode_total_s"))
# Columns of the throughput table: the seed's prefill column under its name and definition, glowplug's beside it.
THROUGHPUT_COLUMNS = (
    ("Prefill (requests/s)", "prefill_requests_per_s"),
    ("Prefill (prompt tokens/s)", "prefill_tokens_per_s"),
    ("Decode (tokens/s)", "decode_tokens_per_s"),
)
LATENCY_DEFINITIONS = (
    "Prefill: requests added -> every sequence of the batch has its first token, one sample per run. Decode (token): "
    "one sample per decode step over all runs (decode length - 1 a run). Decode (total): that run's decode time, "
    "first tokens -> last sequence finished, one sample per run. n: samples; p50 is the median, Lowest/Highest the "
    "min-max spread."
)
THROUGHPUT_DEFINITIONS = (
    "Prefill (requests/s): seed 001's Prefill throughput under its own definition, batch / prefill latency (TGI "
    "prints it as tokens/secs; it counts sequences, each yielding its first token). Prefill (prompt tokens/s): "
    "glowplug's, batch x sequence length / prefill latency (= requests/s x sequence length). Decode (tokens/s): "
    "seed 001's and glowplug's, batch x (decode length - 1) / Decode (total): tokens after each sequence's first "
    "over the time after the first tokens. One sample per run; cells are median (min–max) over the n runs."
)


def _stat_cells(summary: Summary | None, names: tuple[str, ...], unit: str, reason: str | None) -> list[Cell]:
    """TGI's cells (value and unit, as in seed 001). One sample has no lowest, highest or percentiles apart from
    itself: those cells say n=1 instead of repeating the value as if it were a distribution."""
    if summary is None:
        return [Missing(reason or "no samples")] * len(names)
    if summary.n == 1:
        return [f"{fmt_num(summary.mean)} {unit} (n=1)", *(["n=1"] * (len(names) - 1))]
    return [f"{fmt_num(getattr(summary, n))} {unit}" for n in names]


def _samples(cell: LatencyCell, attr: str) -> int | Missing:
    return len(getattr(cell, attr)) if cell.ok else Missing(cell.reason or "no samples")


def cell_summary(cell: LatencyCell, attr: str, scale: float = 1.0) -> Summary | None:
    values = getattr(cell, attr)
    return summarize(values).scaled(scale) if cell.ok and values else None


def render_tables(result: LatencyResult, quant: str, tp: int = 1) -> str:
    cells = [c for c in result.cells if c.quantization == quant and c.tensor_parallel_size == tp]
    stats = ("mean", "min", "max", "p50", "p90", "p99")
    lat_rows: list[list[Cell]] = []
    for label, attr in LATENCY_ROWS:
        for c in cells:
            lat_rows.append(
                [label, c.batch, _samples(c, attr), *_stat_cells(cell_summary(c, attr, 1000.0), stats, "ms", c.reason)]
            )
    tput_rows: list[list[Cell]] = []
    for c in cells:
        tput_rows.append(
            [
                c.batch,
                _samples(c, "prefill_s"),
                *(
                    fmt_spread(getattr(c, attr)) if c.ok and getattr(c, attr) else Missing(c.reason or "no samples")
                    for _, attr in THROUGHPUT_COLUMNS
                ),
            ]
        )
    head = ["Step", "Batch Size", "n", "Average", "Lowest", "Highest", "p50", "p90", "p99"]
    latency_table = markdown_table(head, lat_rows, ["l"] * 2 + ["r"] * 7)
    tput_head = ["Batch Size", "n (runs)", *(h for h, _ in THROUGHPUT_COLUMNS)]
    # Each table carries its own caption: a reader who copies one table keeps the settings it was measured at.
    setting = result.setting(run_label(result.config, quant, tp))
    if result.config.tensor_parallel_size != (1,):
        setting = f"tensor parallel {tp}, {setting}"
    return (
        f"Latency ({setting}, sequence length {result.config.sequence_length}, decode length "
        f"{result.config.decode_length}):\n\n"
        + latency_table
        + "\n\n"
        + LATENCY_DEFINITIONS
        + f"\n\nThroughput ({setting}):\n\n"
        + markdown_table(tput_head, tput_rows, ["l"] + ["r"] * 4)
        + "\n\n"
        + THROUGHPUT_DEFINITIONS
    )


def _arguments(result: LatencyResult) -> str:
    cfg = result.config
    sampled = cfg.temperature > 0
    blocks = ", ".join(f"{q}: {n:,}" for q, n in result.kv_blocks.items()) or "no engine started"
    rows: list[list[Cell]] = [
        ["Model", cfg.model],
        ["Quantization", ", ".join(cfg.quantization)],
        ["Tensor Parallel", ", ".join(map(str, cfg.tensor_parallel_size))],
        [
            "dtype / compile",
            "; ".join(
                f"{label}: {result.setting(label)}"
                for label in (run_label(cfg, q, tp) for tp in cfg.tensor_parallel_size for q in cfg.quantization)
            ),
        ],
        ["Sequence Length", cfg.sequence_length],
        ["Decode Length", cfg.decode_length],
        ["N Runs", cfg.runs],
        ["Warmups", cfg.warmups],
        ["Do Sample", sampled],
        ["Temperature", f"{cfg.temperature:g}" if sampled else "0 (greedy)"],
        ["Top K", "disabled" if cfg.top_k <= 0 else cfg.top_k],
        ["Top P", f"{cfg.top_p:g}"],
        ["Repetition Penalty", f"{cfg.repetition_penalty:g}"],
        ["Step token budget", engine_fields(cfg, "none")["max_num_batched_tokens"]],
        ["KV blocks", f"{blocks} (block size {cfg.block_size})"],
    ]
    return markdown_table(["Parameter", "Value"], rows, ["l", "l"])


def render_markdown(result: LatencyResult, argv: list[str] | None = None) -> str:
    from .machine import report_header

    parts = [report_header("Latency benchmark", argv), "## Experiment Generation Arguments", "", _arguments(result), ""]
    for tp in result.config.tensor_parallel_size:
        for quant in result.config.quantization:
            head = quantization_label(quant)
            if result.config.tensor_parallel_size != (1,):
                head = f"Tensor parallel {tp} · {head}"
            parts += [f"## {head}", "", render_tables(result, quant, tp), ""]
    steps = {c.prefill_steps for c in result.cells if c.ok}
    parts += [
        "## How these numbers are taken",
        "",
        "- Prefill: requests added -> every sequence of the batch has its first token (one sample per run"
        + (f"; took {', '.join(map(str, sorted(steps)))} engine step(s))." if steps else ")."),
        "- Decode (token): one sample per decode step across all runs; Decode (total): one sample per run.",
        "- Throughput: Prefill (requests/s) is seed 001's column under its definition, batch / prefill (TGI labels "
        "it tokens/secs); Prefill (prompt tokens/s) is glowplug's, batch x sequence length / prefill; Decode "
        "(tokens/s) = batch x (decode length - 1) / Decode (total), the same in both.",
        f"- Percentiles: {PERCENTILE_METHOD}; always min <= p50 <= p90 <= p99 <= max. A row of one sample shows "
        "its value once and n=1 where a spread would be (one run has no lowest, highest or percentiles).",
        "- Each table's caption states the dtype and compile mode the engine resolved (compile on: the decode step "
        "as one compiled graph; off: eager).",
        "- Prefix caching is off, so every run prefills its prompts in full.",
        *(
            [
                "- Tensor parallel N runs N ranks on this machine (gloo on the CPU), each with its shard of the "
                "weights, two all-reduces per layer and a gather of the logits per step; on a CPU the ranks share its "
                "cores and memory bandwidth, so TP > 1 is slower here: it shows correctness and the per-rank start-up, "
                "not the speed of a GPU per rank."
            ]
            if result.config.tensor_parallel_size != (1,)
            else []
        ),
        "",
    ]
    return "\n".join(parts)


def result_dict(result: LatencyResult) -> dict[str, Any]:
    cells = []
    for c in result.cells:
        entry: dict[str, Any] = asdict(c)
        entry["status"] = "ok" if c.ok else "skipped"
        entry["summary"] = {
            attr: s.as_dict()
            for _, attr in (*LATENCY_ROWS, *THROUGHPUT_COLUMNS)
            if (s := cell_summary(c, attr)) is not None
        }
        # Each run's values side by side (as seed 002's "Individual runs"); decode_token_s stays a flat list above.
        steps = max(c.runs_decode_steps(), 0)
        entry["runs"] = [
            {
                "run": i + 1,
                "prefill_s": c.prefill_s[i],
                "decode_total_s": c.decode_total_s[i],
                "decode_token_s": c.decode_token_s[i * steps : (i + 1) * steps],
                "prefill_requests_per_s": c.prefill_requests_per_s[i],
                "prefill_tokens_per_s": c.prefill_tokens_per_s[i],
                "decode_tokens_per_s": c.decode_tokens_per_s[i],
            }
            for i in range(len(c.prefill_s))
        ]
        cells.append(entry)
    return {
        "config": result.config.model_dump(mode="json"),
        "percentile_method": PERCENTILE_METHOD,
        "units": {
            "*_s": "seconds",
            "prefill_requests_per_s": "sequences per second (seed 001's Prefill)",
            "*tokens_per_s": "tokens per second",
        },
        "kv_blocks": result.kv_blocks,
        "cells": cells,
    }


def write_reports(result: LatencyResult, argv: list[str] | None = None) -> list[Path]:
    out = prepare_out_dir(result.config.out_dir)
    md, js = out / "latency.md", out / "latency.json"
    md.write_text(render_markdown(result, argv))
    write_json(js, result_dict(result))
    written = [md, js]
    if result.config.plots:
        written.append(plot_latency(result, out / "latency.png"))
    return written


def plot_latency(result: LatencyResult, path: Path) -> Path:
    """Prefill and per-token decode latency against batch size, one line per quantization (with its dtype and
    compile mode in the legend, so two lines never differ by an unstated setting)."""
    from .plots import plot_latency_vs_batch

    cfg = result.config
    panels: dict[str, dict[str, list[tuple[int, Summary]]]] = {}
    for title, attr in (("Prefill", "prefill_s"), ("Decode (token)", "decode_token_s")):
        panels[title] = {
            f"{run_label(cfg, q, tp)} ({result.setting(run_label(cfg, q, tp))})": [
                (c.batch, s)
                for c in result.cells
                if c.quantization == q and c.tensor_parallel_size == tp and (s := cell_summary(c, attr, 1000.0))
            ]
            for tp in cfg.tensor_parallel_size
            for q in cfg.quantization
        }
    title = (
        f"glowplug latency vs batch size: {cfg.model}, sequence length {cfg.sequence_length} prompt tokens, "
        f"decode length {cfg.decode_length} tokens, {cfg.runs} runs per batch size"
    )
    return plot_latency_vs_batch(panels, path, title=title)


def main(cfg: LatencyBenchConfig, argv: list[str] | None = None) -> int:
    from rich.console import Console

    from glowplug.profiling.logs import configure_logging

    configure_logging(level="warning")
    err = Console(stderr=True)
    result = run_latency_bench(cfg, progress=lambda msg: err.print(msg, markup=False))
    paths = write_reports(result, argv)
    print(render_markdown(result, argv))  # plain Markdown: a terminal-fitted table would truncate numbers
    err.print("wrote " + ", ".join(map(str, paths)), markup=False)
    return 0 if any(c.ok for c in result.cells) else 1


def register(subparsers: Any, add_model_flags: AddModelFlags) -> Any:
    return add_command(
        subparsers,
        "latency",
        help_text="Prefill/decode latency and throughput per batch size (TGI benchmark tables).",
        description=__doc__,
        config_cls=LatencyBenchConfig,
        add_model_flags=add_model_flags,
        runner=main,
    )
