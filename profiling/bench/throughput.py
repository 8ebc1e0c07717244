"""`glowplug bench throughput`: the reference sweep's seven named batch shapes run for each quantization scheme, with
end-to-end latency, three throughputs, every run's values in one `summary.json`, a Markdown summary and a ranking.

A run is one batch of `batch` prompts of `input` tokens, each generating exactly `output` tokens (EOS ignored):
  latency             requests added -> last sequence finished (seconds)
  input throughput    prompt tokens / prefill time (requests added -> every sequence has its first token);
                      the reference sweep printed 0.00 here for every run: it never measured the prefill
  output throughput   tokens after each sequence's first token / time after the first tokens
                      (`BatchTiming.output_tokens_per_s`, the one decode rate of every glowplug report). The
                      reference does not state whether it counts the first token; at its lengths (>= 32 tokens a
                      sequence) the two readings differ by <= 3%, inside its run-to-run spread, so its column name
                      is kept.
  e2e output tput     glowplug's own column: output tokens / latency (prefill included)
  overall throughput  (prompt + output tokens) / latency
Cells are median (min-max) over the n runs. A scheme is compared with `none` only at the same dtype and compile
mode, by paired ratios (run i over `none`'s run i); the ranking shows their median and the worst pair. Schemes that
`--quality-from` marks unusable are listed (and drawn hatched) after the usable ones, never ranked among them.
A configuration longer than the model allows keeps its output length and has its input clipped to fit, with a
note. The engine uses its default chunked-prefill scheduling (step token budget: max(2048, longest input)), so a
large batch is prefilled over several steps, as a server would. Prefix caching is off so that every run prefills.
Run ids are `<quantization>_<config>_run<i>`, unique by construction (the reference sweep listed a run twice).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from glowplug.engine.config import Quantization

from .cli_support import AddModelFlags, BenchEngineFields, add_command, prepare_out_dir, write_json
from .stats import Summary, summarize
from .tables import Cell, Missing, fmt_num, fmt_spread, markdown_table

ConfigName = Literal[
    "interactive", "decode_bound", "prefill_bound", "long_context", "medium_batch", "base", "high_concurrency"
]
# name -> (batch size, input tokens, output tokens)
NAMED_CONFIGS: dict[str, tuple[int, int, int]] = {
    "interactive": (1, 128, 64),
    "decode_bound": (1, 256, 512),
    "prefill_bound": (1, 2048, 32),
    "long_context": (1, 16384, 32),
    "medium_batch": (8, 256, 128),
    "base": (32, 256, 32),
    "high_concurrency": (64, 256, 128),
}
Progress = Callable[[str], None]


class ThroughputBenchConfig(BenchEngineFields):
    quantization: tuple[Quantization, ...] = Field(("none",), min_length=1, description="Schemes to compare.")
    configs: tuple[ConfigName, ...] = Field(
        tuple(NAMED_CONFIGS), min_length=1, description="Named shapes to run (all by default; they take long)."
    )  # type: ignore[assignment]
    runs: int = Field(3, ge=1, description="Timed runs per (scheme, configuration).")
    warmups: int = Field(0, ge=0, description="Untimed runs before them (start-up already ran a warm-up).")
    quality_from: Path | None = Field(None, description="Accuracy JSON whose >2x-bf16-perplexity formats get flagged.")
    skip_unusable: bool = Field(
        False,
        description="Do not time the schemes that --quality-from flags unusable; their rows say why (saves "
        "the time of a format no one should deploy).",
    )
    # Under the working directory, named after the command: never the checkout's reports/ unless asked.
    out_dir: Path = Field(Path("throughput"), description="Where summary.md, summary.json and ranking.png go.")
    plots: bool = True

    @model_validator(mode="after")
    def _distinct(self) -> ThroughputBenchConfig:
        for name in ("quantization", "configs"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ValueError(f"--{name} lists a value twice: {list(values)}")
        return self


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    input_len: int
    output_len: int
    note: str | None = None  # why the shape differs from its named definition
    impossible: str | None = None  # why the shape cannot run on this model at all

    @property
    def title(self) -> str:
        return f"batch_size={self.batch}, input_len={self.input_len}, output_len={self.output_len}"


@dataclass(frozen=True)
class RunRecord:
    """One entry of summary.json's `runs`: a timed run, or a (scheme, configuration) that could not run."""

    run_id: str
    status: Literal["ok", "skipped"]
    config: str
    quantization: str
    run: int | None
    batch_size: int
    input_len: int
    output_len: int
    reason: str | None = None
    latency_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    input_throughput: float | None = None
    decode_tokens: int | None = None  # tokens after each sequence's first (the output throughput's numerator)
    output_throughput: float | None = None  # decode_tokens / decode_s (BatchTiming.output_tokens_per_s)
    overall_throughput: float | None = None
    e2e_output_throughput: float | None = None  # glowplug's own: output tokens / end-to-end latency
    dtype: str | None = None  # the engine's resolved model dtype
    compile: str | None = None  # "on" when the decode step ran as a compiled graph, else "off"


def resolve_shapes(names: tuple[str, ...], limit: int) -> list[Shape]:
    """The named shapes, with inputs clipped so that input + output fits the model's `limit` positions."""
    shapes = []
    for name in names:
        batch, inp, out = NAMED_CONFIGS[name]
        if inp + out <= limit:
            shapes.append(Shape(name, batch, inp, out))
            continue
        clipped = limit - out
        if clipped < 1:
            why = f"{out} output tokens exceed the model's {limit} positions"
            shapes.append(Shape(name, batch, inp, out, impossible=why))
            continue
        note = f"input clipped from {inp} to {clipped} tokens: the model allows {limit} positions"
        shapes.append(Shape(name, batch, clipped, out, note=note))
    return shapes


def engine_fields(cfg: ThroughputBenchConfig, quant: str, shapes: list[Shape]) -> dict[str, Any]:
    runnable = [s for s in shapes if s.impossible is None]
    longest = max((s.input_len + s.output_len for s in runnable), default=1)
    return cfg.engine_fields(
        quantization=quant,
        max_model_len=longest,
        max_num_seqs=max(s.batch for s in shapes),
        max_num_batched_tokens=cfg.max_num_batched_tokens or max(2048, *(s.input_len for s in runnable)),
        enable_prefix_caching=False,
    )


# The BatchTiming figures a run's record carries under the same names.
TIMING_FIELDS = ("latency_s", "prefill_s", "decode_s", "prompt_tokens", "generated_tokens", "decode_tokens")


def _shape_fields(quant: str, shape: Shape) -> dict[str, Any]:
    """What every record of (scheme, configuration) holds, timed or skipped."""
    return {
        "config": shape.name,
        "quantization": quant,
        "batch_size": shape.batch,
        "input_len": shape.input_len,
        "output_len": shape.output_len,
    }


def _record(
    quant: str, shape: Shape, i: int, t: Any, dtype: str | None = None, compile: str | None = None
) -> RunRecord:
    figures = {name: getattr(t, name) for name in TIMING_FIELDS}
    return RunRecord(
        run_id=f"{quant}_{shape.name}_run{i}",
        status="ok",
        run=i,
        **_shape_fields(quant, shape),
        **figures,
        input_throughput=t.prefill_tokens_per_s,
        output_throughput=t.output_tokens_per_s,
        overall_throughput=(t.prompt_tokens + t.generated_tokens) / t.latency_s,
        e2e_output_throughput=t.generated_tokens / t.latency_s,
        dtype=dtype,
        compile=compile,
    )


def _skipped(quant: str, shape: Shape, reason: str) -> RunRecord:
    return RunRecord(
        run_id=f"{quant}_{shape.name}", status="skipped", run=None, reason=reason, **_shape_fields(quant, shape)
    )


JSON_NAME = "summary.json"


class ResultsFile:
    """The report's one JSON, rewritten as runs finish (`"partial": true`) so that a long benchmark that is stopped
    keeps its runs; `write_reports` replaces it with the complete file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[RunRecord] = []
        write_json(path, {"partial": True, "runs": []})

    def add(self, record: RunRecord) -> None:
        if any(r.run_id == record.run_id for r in self.records):
            raise ValueError(f"run id {record.run_id} recorded twice")
        self.records.append(record)
        write_json(self.path, {"partial": True, "runs": [asdict(r) for r in self.records]})


def run_throughput_bench(
    cfg: ThroughputBenchConfig, progress: Progress | None = None
) -> tuple[list[Shape], list[RunRecord]]:
    import gc

    from glowplug.base.errors import one_line
    from glowplug.engine.sampling_params import SamplingParams

    from .decode import make_prompts
    from .quality import load_flags
    from .timing import build_llm, model_position_limit, time_batch, why_cannot_run

    say = progress or (lambda _msg: None)
    shapes = resolve_shapes(cfg.configs, model_position_limit(cfg.model))
    results = ResultsFile(prepare_out_dir(cfg.out_dir) / JSON_NAME)
    flags = load_flags(cfg.quality_from) if cfg.skip_unusable else {}
    for quant in cfg.quantization:
        if quant in flags:
            for shape in shapes:
                results.add(_skipped(quant, shape, f"not timed (--skip-unusable): {flags[quant].removeprefix('⚠ ')}"))
            continue
        say(f"[{quant}] starting the engine")
        llm, why = build_llm(engine_fields(cfg, quant, shapes))
        for shape in shapes:
            if llm is None:
                reason = why
            elif shape.impossible is not None:
                reason = shape.impossible
            else:
                reason = why_cannot_run(llm.engine, shape.batch, shape.input_len, shape.output_len)
            if reason is not None:
                say(f"[{quant}] {shape.name}: skipped ({reason})")
                results.add(_skipped(quant, shape, reason))
                continue
            params = SamplingParams(temperature=0.0, max_tokens=shape.output_len, ignore_eos=True)
            dtype = str(llm.startup.dtype).removeprefix("torch.")
            mode = "on" if llm.engine.compiled else "off"
            prompts = make_prompts(llm.tokenizer, shape.batch, shape.input_len)
            try:
                for _ in range(cfg.warmups):
                    time_batch(llm.engine, prompts, params)
                for i in range(1, cfg.runs + 1):
                    say(f"[{quant}] {shape.name}: run {i}/{cfg.runs}")
                    results.add(_record(quant, shape, i, time_batch(llm.engine, prompts, params), dtype, mode))
            except Exception as exc:  # a scheme still being wired may fail mid-run: the table says how
                for req_id in llm.engine.request_ids():
                    llm.engine.abort(req_id)
                results.add(_skipped(quant, shape, f"failed: {one_line(exc)}"))
        llm = None
        gc.collect()
    return shapes, results.records


# ---------------------------------------------------------------- summary, ranking, rendering

METRICS = (
    ("latency_s", "Latency (s)"),
    ("output_throughput", "Output Throughput (tok/s)"),
    ("overall_throughput", "Overall Throughput (tok/s)"),
    ("input_throughput", "Input Throughput (tok/s)"),
    ("e2e_output_throughput", "glowplug E2E Output Throughput (tok/s)"),
)
# One paragraph under every table: the seed's columns under their names, glowplug's own column named apart.
DEFINITIONS = (
    "Latency: requests added -> last sequence finished. Output Throughput: tokens after each sequence's first token "
    "/ time after the first tokens, i.e. batch x (output_len - 1) / decode time (the first tokens come out of the "
    "prefill, so they are neither counted nor timed; seed 002 does not say whether it counts them, and at its "
    "lengths the two readings differ by at most 3%, inside its run-to-run spread). Overall Throughput: (prompt + "
    "output tokens) / latency. Input Throughput: prompt tokens / prefill time (seed 002 printed 0.00). glowplug "
    "E2E Output Throughput (not in the seed): all output tokens / latency. Cells: median (min–max) over the n runs "
    "in the Runs column; one run shows (n=1)."
)
RANK_METRIC = "output_throughput"


@dataclass(frozen=True)
class VariantSummary:
    config: str
    quantization: str
    runs: int
    stats: dict[str, Summary]  # metric -> summary over the runs (median = p50, min, max)
    reason: str | None = None
    dtype: str | None = None
    compile: str | None = None


def summarize_runs(shapes: list[Shape], records: list[RunRecord], quants: tuple[str, ...]) -> list[VariantSummary]:
    out = []
    for shape in shapes:
        for quant in quants:
            ok = [r for r in records if r.config == shape.name and r.quantization == quant and r.status == "ok"]
            skipped = [r for r in records if r.config == shape.name and r.quantization == quant and r.status != "ok"]
            stats = {}
            for m, _ in METRICS:
                values = [getattr(r, m) for r in ok if getattr(r, m) is not None]
                if values:
                    stats[m] = summarize(values)
            reason = None if ok else (skipped[0].reason if skipped else "not run")
            dtype = ok[0].dtype if ok else None
            mode = ok[0].compile if ok else None
            out.append(VariantSummary(shape.name, quant, len(ok), stats, reason, dtype, mode))
    return out


def ranking(
    summaries: list[VariantSummary], config: str, unusable: Mapping[str, str] | None = None
) -> list[VariantSummary]:
    """The usable schemes that ran `config`, best median output throughput first; the `unusable` ones (quality
    flags) follow, best first, so a broken format is never ranked above a working one."""
    ran = [s for s in summaries if s.config == config and RANK_METRIC in s.stats]
    bad = unusable or {}
    key = lambda s: (s.quantization in bad, -s.stats[RANK_METRIC].p50)  # noqa: E731
    return sorted(ran, key=key)


def spread(values: list[float], digits: int = 2) -> Cell:
    return fmt_spread(values, digits) if values else Missing("no samples")


def baseline_for(s: VariantSummary, ranked: list[VariantSummary]) -> VariantSummary | None:
    """The unquantized run at the same dtype and compile mode as `s` (None when there is none to compare with)."""
    return next((b for b in ranked if b.quantization == "none" and (b.dtype, b.compile) == (s.dtype, s.compile)), None)


def paired_ratios(records: list[RunRecord], config: str, quant: str, base: str = "none") -> list[float]:
    """Output throughput of run i of `quant` over run i of `base` on `config`, for every i both have."""

    def by_run(q: str) -> dict[int, float]:
        return {
            r.run: r.output_throughput
            for r in records
            if r.config == config
            and r.quantization == q
            and r.status == "ok"
            and r.run is not None
            and r.output_throughput is not None
        }

    mine, theirs = by_run(quant), by_run(base)
    return [mine[i] / theirs[i] for i in sorted(mine) if i in theirs and theirs[i] > 0]


UNUSABLE_LABEL = "unusable: perplexity > {limit:g}x bf16"


def ranking_plot_groups(
    shapes: list[Shape], summaries: list[VariantSummary], flags: Mapping[str, str]
) -> dict[str, list[tuple[str, float, float, float, str | None]]]:
    """plot_ranking's data: config -> [(label with n, median, min, max, unusable label or None)], usable first."""
    from .quality import QUALITY_LIMIT

    groups: dict[str, list[tuple[str, float, float, float, str | None]]] = {}
    for shape in shapes:
        bars = []
        for v in ranking(summaries, shape.name, flags):
            st = v.stats[RANK_METRIC]
            mark = UNUSABLE_LABEL.format(limit=QUALITY_LIMIT) if v.quantization in flags else None
            bars.append((f"{v.quantization} (n={st.n})", st.p50, st.min, st.max, mark))
        if bars:
            groups[f"{shape.name} ({shape.title})"] = bars
    return groups


def config_table(shapes: list[Shape], summaries: list[VariantSummary]) -> str:
    """Every one of seed 002's seven configurations, its shape here, and whether (and how often) it ran."""
    by_name = {s.name: s for s in shapes}
    rows: list[list[Cell]] = []
    for name, (batch, inp, out) in NAMED_CONFIGS.items():
        shape = by_name.get(name)
        if shape is None:
            rows.append([f"`{name}`", batch, inp, out, Missing("not in --configs: not run")])
            continue
        ran = [v for v in summaries if v.config == name and v.runs]
        status = (
            f"{len(ran)} scheme(s) x {max(v.runs for v in ran)} run(s)"
            if ran
            else str(Missing(shape.impossible or "no scheme ran (see its table)"))
        )
        if shape.note:
            status += f"; {shape.note}"
        rows.append([f"`{name}`", shape.batch, shape.input_len, shape.output_len, status])
    return markdown_table(["Configuration", "batch_size", "input_len", "output_len", "Ran"], rows)


def render_markdown(
    cfg: ThroughputBenchConfig, shapes: list[Shape], records: list[RunRecord], argv: list[str] | None
) -> str:
    from .machine import report_header
    from .quality import flag_note, load_flags

    flags = load_flags(cfg.quality_from)

    def scheme(q: str) -> str:
        return f"`{q}` {flags[q]}" if q in flags else f"`{q}`"

    summaries = summarize_runs(shapes, records, cfg.quantization)
    parts = [
        report_header("Throughput benchmark", argv),
        f"Model `{cfg.model}`, {cfg.runs} timed run(s) per configuration and scheme, {cfg.warmups} warm-up(s), "
        f"greedy, EOS ignored, requested dtype `{cfg.dtype}`, compile `{cfg.compile}` (each row shows what the "
        f"engine resolved them to). Values are median (min–max) over the runs. Every run's values: `{JSON_NAME}`.",
        "",
        "## Configurations (seed 002's seven)",
        "",
        config_table(shapes, summaries),
        "",
    ]
    for shape in shapes:
        parts += [f"## Configuration: {shape.name} ({shape.title})", ""]
        if shape.note:
            parts += [f"> Note: {shape.note}.", ""]
        rows: list[list[Cell]] = []
        for s in (x for x in summaries if x.config == shape.name):
            if not s.stats:
                why = Missing(s.reason or "not run")
                rows.append([scheme(s.quantization), why, why, 0, *[why] * len(METRICS)])
                continue
            ok = [
                r for r in records if r.config == shape.name and r.quantization == s.quantization and r.status == "ok"
            ]
            stats: list[Cell] = [
                spread([getattr(r, m) for r in ok], 3 if m == "latency_s" else 2)
                if m in s.stats
                else Missing("no decode phase: one output token")
                for m, _ in METRICS
            ]
            rows.append([scheme(s.quantization), s.dtype or "?", s.compile or "?", s.runs, *stats])
        head = ["Scheme", "dtype", "compile", "Runs", *(h for _, h in METRICS)]
        parts += [markdown_table(head, rows), "", DEFINITIONS, ""]
        if any(s.quantization in flags for s in summaries if s.config == shape.name):
            parts += [flag_note(flags), ""]
        runs = [r for r in records if r.config == shape.name and r.status == "ok"]
        if runs:
            detail: list[list[Cell]] = [
                [
                    f"`{r.run_id}`",
                    fmt_num(r.latency_s or 0, 3),
                    fmt_num(r.prefill_s or 0, 3),
                    fmt_num(r.decode_s or 0, 3),
                    fmt_num(r.output_throughput) if r.output_throughput is not None else Missing("no decode phase"),
                    fmt_num(r.overall_throughput or 0),
                    fmt_num(r.input_throughput or 0),
                    fmt_num(r.e2e_output_throughput or 0),
                ]
                for r in runs
            ]
            head = [
                "Run",
                "Latency (s)",
                "Prefill (s)",
                "Decode (s)",
                "Output (tok/s)",
                "Overall (tok/s)",
                "Input (tok/s)",
                "E2E Output (tok/s)",
            ]
            table = markdown_table(head, detail)
            parts += ["<details><summary>Individual runs</summary>", "", table, "", "</details>", ""]
    parts += [
        "## Ranking by output throughput",
        "",
        "Output Throughput as defined under the tables (tokens after each sequence's first / time after the "
        "first tokens), median (min–max) over n runs. `vs none`: the paired ratios run i / `none`'s run i "
        "(each scheme runs on its own engine, one after another), their median and the worst pair, at the "
        "same dtype and compile mode only. Schemes flagged unusable by the accuracy report are listed after "
        "the ranked ones and not ranked.",
        "",
    ]
    for shape in shapes:
        ranked = ranking(summaries, shape.name, flags)
        parts += [f"### {shape.name} ({shape.title})", ""]
        if not ranked:
            parts.append("No scheme ran this configuration.")
        place = 0
        for s in ranked:
            st = s.stats[RANK_METRIC]
            values = [
                r.output_throughput
                for r in records
                if r.config == shape.name
                and r.quantization == s.quantization
                and r.status == "ok"
                and r.output_throughput is not None
            ]
            base = baseline_for(s, ranked)
            vs = ""
            if s.quantization != "none":
                pairs = paired_ratios(records, shape.name, s.quantization) if base is not None else []
                if pairs:
                    med = summarize(pairs).p50
                    vs = (
                        f" ({med:.2f}x vs none, worst pair {min(pairs):.2f}x, {len(pairs)} pairs, at {s.dtype}, "
                        f"compile {s.compile})"
                    )
                else:
                    vs = f" (no `none` run at {s.dtype}, compile {s.compile} to compare with)"
            text = f"**{s.quantization}** ({s.dtype}, compile {s.compile}): {fmt_spread(values)} tok/s, n={st.n}{vs}"
            if s.quantization in flags:
                parts.append(f"- not ranked: {text} {flags[s.quantization]}")
            else:
                place += 1
                parts.append(f"{place}. {text}")
        for s in summaries:  # a scheme that did not run this configuration is named with its reason, not dropped
            if s.config == shape.name and RANK_METRIC not in s.stats:
                parts.append(f"- not ranked: **{s.quantization}**: {Missing(s.reason or 'not run')}")
        parts.append("")
    return "\n".join(parts)


def write_reports(
    cfg: ThroughputBenchConfig, shapes: list[Shape], records: list[RunRecord], argv: list[str] | None = None
) -> list[Path]:
    from .quality import load_flags

    out = prepare_out_dir(cfg.out_dir)
    md = out / "summary.md"
    md.write_text(render_markdown(cfg, shapes, records, argv))
    summaries = summarize_runs(shapes, records, cfg.quantization)
    flags = load_flags(cfg.quality_from)
    js = out / JSON_NAME
    write_json(
        js,
        {
            "partial": False,
            "config": cfg.model_dump(mode="json"),
            "definitions": DEFINITIONS,
            "named_configs": {
                k: {"batch_size": b, "input_len": i, "output_len": o} for k, (b, i, o) in NAMED_CONFIGS.items()
            },
            "shapes": [asdict(s) for s in shapes],
            "quality_flags": flags,
            "runs": [asdict(r) for r in records],  # every run's values (seed 002's "Individual runs")
            "summaries": [asdict(s) for s in summaries],
        },
    )
    written = [md, js]
    if cfg.plots:
        from .plots import plot_ranking

        groups = ranking_plot_groups(shapes, summaries, flags)
        if groups:
            dtypes = sorted({f"{v.dtype}, compile {v.compile}" for v in summaries if v.stats})
            untimed = sorted({v.quantization for v in summaries if not v.stats and v.quantization in flags})
            if untimed:  # left out of the bars: the figure says so, not only the Markdown
                dtypes.append(f"not timed, unusable: {', '.join(untimed)}")
            written.append(
                plot_ranking(
                    groups,
                    out / "ranking.png",
                    xlabel="Output Throughput, tok/s (tokens after each sequence's first / time after the first "
                    "tokens)",
                    title=f"Output throughput per configuration ({'; '.join(dtypes)}); bar: median over n runs, "
                    "error bar: min–max",
                )
            )
    return written


def main(cfg: ThroughputBenchConfig, argv: list[str] | None = None) -> int:
    from rich.console import Console

    from glowplug.profiling.logs import configure_logging

    configure_logging(level="warning")
    err = Console(stderr=True)
    shapes, records = run_throughput_bench(cfg, progress=lambda msg: err.print(msg, markup=False))
    paths = write_reports(cfg, shapes, records, argv)
    print(render_markdown(cfg, shapes, records, argv))  # plain Markdown: a terminal-fitted table would truncate numbers
    err.print("wrote " + ", ".join(map(str, paths)), markup=False)
    return 0 if any(r.status == "ok" for r in records) else 1


def register(subparsers: Any, add_model_flags: AddModelFlags) -> Any:
    return add_command(
        subparsers,
        "throughput",
        help_text="Seven named batch shapes x quantization schemes: latency, throughputs, summary and ranking.",
        description=__doc__,
        config_cls=ThroughputBenchConfig,
        add_model_flags=add_model_flags,
        runner=main,
    )
