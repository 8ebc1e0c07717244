"""`glowplug tune max-model-len`: how start-up and KV capacity change with max-model-len, and which length to use.

Sweep (default): one `glowplug startup --max-model-len L` per length, each in a fresh process sharing one cache
directory, so every column is a warm-model start and only what depends on L differs. Table: phases as rows,
lengths as columns in numeric order, an `unattributed` row (the wall time no phase claims, so each column adds up
to its time to READY), and the rows KV blocks, token capacity and max concurrency (how many full-length sequences
fit in the KV cache at once).

--plan predicts the same table from ONE start-up (at the smallest length) without restarting:
  KV rows    `engine/kv_sizing.plan_kv_cache` applied to each length with the KV budget that start measured
             (the budget is budget_bytes; blocks = budget // (bytes/token x block size)), so the prediction is
             the engine's own arithmetic, not a copy of it.
  phases     copied from that start: no stage here does work that scales with max-model-len (the profiling pass
             runs max-num-batched-tokens tokens; the cache size follows the budget, not L). The KV profile is an
             artifact keyed without max-model-len (engine/stages/kv_cache_profiling.py), so a sweep profiles once,
             at its first length on a cold cache, and hits at every other length: the plan claims no re-profile.
             No phase plot is drawn for a plan: its columns are copies of one start (identical bars).
  failures   a length the sizing rejects (over the model's limit, or one sequence does not fit) says why, as the
             engine would at start-up.
--min-concurrency K recommends the largest length whose max concurrency is >= K and prints the flags to use.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from glowplug.engine.config import QuantConfig, Quantization
from glowplug.profiling.names import Attr

from .cli_support import AddModelFlags, BenchEngineFields, add_command, engine_flag, prepare_out_dir, write_json
from .startup_runs import KV_ROW, StartupRun, run_startup, short
from .tables import Cell, Missing, fmt_num, fmt_spread, markdown_table

Progress = Callable[[str], None]
KV_ROWS = ("KV blocks", "token capacity", "max concurrency")
SMALLEST_DEFAULT = 256


class TuneMaxModelLenConfig(BenchEngineFields):
    max_model_len: tuple[int, ...] | None = Field(
        None, description="Lengths to try; unset = powers of two from 256 up to the model's limit."
    )
    quantization: Quantization = "none"
    max_num_seqs: int | None = Field(None, ge=1)
    min_concurrency: int | None = Field(None, ge=1, description="Recommend the largest length serving this many.")
    plan: bool = Field(False, description="Predict from one start-up instead of one start-up per length.")
    repeats: int = Field(
        3,
        ge=1,
        description="Starts per max-model-len in a sweep, as that many passes over the "
        "lengths (so drift hits every length alike); cells show the median and min-max, n.",
    )
    cache_dir: Path | None = Field(None, description="GLOWPLUG_CACHE_DIR for the starts; unset = the environment's.")
    timeout_s: float = Field(900.0, gt=0, description="Per start-up.")
    # Relative to the working directory and named after the command, so running it from a checkout never
    # rewrites the committed reports/ unless --out-dir says so.
    out_dir: Path = Field(Path("tune-max-model-len"), description="Where tune.md/.json/.png go.")
    plots: bool = True

    @model_validator(mode="after")
    def _lengths(self) -> TuneMaxModelLenConfig:
        if self.max_model_len is not None and any(n < 1 for n in self.max_model_len):
            raise ValueError("--max-model-len values must be >= 1")
        return self


@dataclass
class Column:
    """One max-model-len: its phases (measured or copied) and KV rows, or why it cannot start."""

    length: int
    phases: dict[str, float | None] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)  # phase row -> why it has no value
    leaves: tuple[str, ...] = ()  # the leaf rows (they stack up to actual_total_time)
    kv_blocks: int | None = None
    block_size: int | None = None
    error: str | None = None
    # Each successful start's phases and KV blocks (a sweep's repeats; a plan's one start or prediction).
    samples: list[dict[str, float | None]] = field(default_factory=list)
    blocks_samples: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # repeats that failed, with why

    @property
    def n(self) -> int:
        return len(self.samples)

    def values(self, row: str) -> list[float]:
        return [v for p in self.samples if (v := p.get(row)) is not None]

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def token_capacity(self) -> int | None:
        return None if self.kv_blocks is None or self.block_size is None else self.kv_blocks * self.block_size

    @property
    def max_concurrency(self) -> float | None:
        if self.kv_blocks is None or self.block_size is None:
            return None
        return self.kv_blocks / -(-self.length // self.block_size)


@dataclass
class TuneResult:
    config: TuneMaxModelLenConfig
    columns: list[Column]
    mode: Literal["sweep", "plan"]
    limit: int
    measured_length: int | None = None  # --plan: the one length that was started
    budget_bytes: int | None = None
    bytes_per_token: int | None = None
    start_reports: list[dict[str, Any]] = field(default_factory=list)  # --plan: the one start's own report


def default_lengths(limit: int) -> list[int]:
    lengths, n = [], SMALLEST_DEFAULT
    while n < limit:
        lengths.append(n)
        n *= 2
    return lengths + [limit]


def _column_from_run(length: int, run: StartupRun, block_size: int) -> Column:
    return column_from_runs(length, [run], block_size)


def _median(values: list[float]) -> float:
    import statistics

    return float(statistics.median(values))


def column_from_runs(length: int, runs: list[StartupRun], block_size: int) -> Column:
    """One length from its repeats: the phase cells are medians over the starts that succeeded (the samples stay,
    for the spread); the column fails only when every repeat did."""
    ok = [r for r in runs if r.ok]
    failures = [f"{r.label}: {r.error or 'start-up failed'}" for r in runs if not r.ok]
    if not ok:
        return Column(length, error=runs[0].error or "start-up failed", failures=failures)
    samples = [r.phases for r in ok]
    names = list(dict.fromkeys(n for p in samples for n in p))
    medians: dict[str, float | None] = {}
    for name in names:
        vals = [v for p in samples if (v := p.get(name)) is not None]
        medians[name] = _median(vals) if vals else None
    blocks = [int(b) for r in ok if (b := r.attr(KV_ROW, Attr.KV_BLOCKS)) is not None]
    reasons = {k: v for r in ok for k, v in r.reasons.items()}
    leaves = tuple(dict.fromkeys(n for r in ok for n in leaf_names(r)))
    return Column(
        length,
        medians,
        reasons,
        leaves,
        int(_median([float(b) for b in blocks])) if blocks else None,
        block_size,
        samples=samples,
        blocks_samples=blocks,
        failures=failures,
    )


def leaf_names(run: StartupRun) -> tuple[str, ...]:
    return tuple(n for n, kind in run.report.get("kinds", {}).items() if kind == "leaf")


def _start(cfg: TuneMaxModelLenConfig, length: int, tmp: Path, rep: int = 1) -> StartupRun:
    args = cfg.startup_argv(quantization=cfg.quantization, max_model_len=length, max_num_seqs=cfg.max_num_seqs)
    report = tmp / f"startup-{length}-{rep}.json"
    return run_startup(
        f"max-model-len {length} run {rep}", args, report, cache_dir=cfg.cache_dir, timeout_s=cfg.timeout_s
    )


def predict_columns(cfg: TuneMaxModelLenConfig, run: StartupRun, lengths: list[int]) -> tuple[list[Column], int, int]:
    """Columns for `lengths` from one successful start `run`; also (budget bytes, bytes per token) it used."""
    import torch

    from glowplug.engine.config import EngineConfig
    from glowplug.engine.kv_sizing import bytes_per_token, plan_kv_cache
    from glowplug.engine.models.arch import load_arch

    arch = load_arch(Path(run.attr("model_prepare", Attr.MODEL_DIR)))
    dtype = getattr(torch, str(run.attr("model_init", Attr.DTYPE) or run.attr("model_prepare", Attr.DTYPE)))
    budget = int(run.attr(KV_ROW, Attr.KV_BUDGET_BYTES))
    columns = []
    per_token = 0
    for length in lengths:
        fields = cfg.engine_fields(quantization=cfg.quantization, max_model_len=length, max_num_seqs=cfg.max_num_seqs)
        if cfg.num_gpu_blocks_override is None:
            fields["kv_cache_memory"] = budget  # the measured budget, whatever it was derived from
        config = EngineConfig.from_flat(**fields)
        per_token = bytes_per_token(arch, config, dtype)
        try:
            plan = plan_kv_cache(config, arch, model_dtype=dtype, device=config.resolved_device(), weights_bytes=0)
        except ValueError as exc:  # KVCacheTooSmall is one: the start-up would fail the same way
            # With the budget given explicitly, as here, the start-up checks it in its first stage.
            columns.append(Column(length, error=f"start-up would fail in model_prepare: {type(exc).__name__}: {exc}"))
            continue
        columns.append(
            Column(
                length,
                dict(run.phases),
                dict(run.reasons),
                leaf_names(run),
                plan.num_blocks,
                plan.block_size,
                samples=[dict(run.phases)],
                blocks_samples=[plan.num_blocks],
            )
        )
    return columns, budget, per_token


def run_tune(cfg: TuneMaxModelLenConfig, progress: Progress | None = None) -> TuneResult:
    from .timing import model_position_limit

    say = progress or (lambda _msg: None)
    limit = model_position_limit(cfg.model, cfg.cache_dir)
    lengths = sorted(set(cfg.max_model_len or default_lengths(limit)))
    prepare_out_dir(cfg.out_dir)
    with tempfile.TemporaryDirectory(prefix="glowplug-tune-") as tmp:
        if cfg.plan:
            say(f"one start-up at max-model-len {lengths[0]}, then predicting {len(lengths)} lengths")
            run = _start(cfg, lengths[0], Path(tmp))
            plan_report = run.report  # kept in tune-plan.json (one JSON per report)
            if not run.ok:
                cols = [Column(n, error=f"the one profiling start failed: {run.error}") for n in lengths]
                return TuneResult(cfg, cols, "plan", limit, lengths[0], start_reports=[plan_report])
            cols, budget, per_token = predict_columns(cfg, run, lengths)
            return TuneResult(cfg, cols, "plan", limit, lengths[0], budget, per_token, start_reports=[plan_report])
        runs: dict[int, list[StartupRun]] = {n: [] for n in lengths}
        # Passes over all lengths rather than repeats of one length: a slow drift of the machine spreads over
        # every length instead of biasing the last ones.
        for rep in range(1, cfg.repeats + 1):
            for n in lengths:
                say(f"start-up with max-model-len {n} (pass {rep}/{cfg.repeats})")
                runs[n].append(_start(cfg, n, Path(tmp), rep))
        columns = [column_from_runs(n, runs[n], cfg.block_size) for n in lengths]
        return TuneResult(cfg, columns, "sweep", limit)


# ---------------------------------------------------------------- recommendation


@dataclass(frozen=True)
class Recommendation:
    min_concurrency: int
    length: int | None
    exact_bound: int | None  # largest length (any value, not just swept ones) with enough blocks for K sequences
    flags: list[str]
    text: str


def recommend(result: TuneResult) -> Recommendation | None:
    cfg = result.config
    k = cfg.min_concurrency
    if k is None:
        return None
    fits = [c for c in result.columns if c.ok and (c.max_concurrency or 0) >= k]
    blocks = sorted({c.kv_blocks for c in result.columns if c.ok and c.kv_blocks is not None})
    bound = min(result.limit, (blocks[0] // k) * cfg.block_size) if blocks else None
    if not fits:
        text = f"No swept max-model-len serves {k} full-length sequences at once."
        if bound:
            text += f" The KV cache ({blocks[0]:,} blocks) would at {bound} tokens; try `--max-model-len {bound}`."
        return Recommendation(k, None, bound, [], text)
    best = max(fits, key=lambda c: c.length)
    flags = engine_flag("max_model_len", best.length)
    from glowplug.engine.config import SchedulerConfig

    default_seqs = int(SchedulerConfig.model_fields["max_num_seqs"].default)
    if cfg.max_num_seqs is not None or k > default_seqs:
        flags += engine_flag("max_num_seqs", max(k, cfg.max_num_seqs or default_seqs))
    command = " ".join(["glowplug serve", cfg.model, *flags, *non_default_flags(cfg)])
    text = (
        f"Largest swept max-model-len serving {k} full-length sequences: **{best.length}** "
        f"(max concurrency {best.max_concurrency:.2f}). Use: `{command}`"
    )
    if bound is not None and bound > best.length:
        text += f". Any length up to {bound} would still fit {k} ({blocks[0]:,} blocks of {cfg.block_size} tokens)."
    return Recommendation(k, best.length, bound, flags, text)


def non_default_flags(cfg: TuneMaxModelLenConfig) -> list[str]:
    """The engine flags of the sweep that differ from the defaults: what the recommended command must repeat."""
    fields = cfg.engine_fields(quantization=cfg.quantization, max_num_seqs=cfg.max_num_seqs)
    fields.pop("model")
    defaults = {name: info.default for name, info in BenchEngineFields.model_fields.items()}
    defaults.update(quantization=QuantConfig.model_fields["quantization"].default, max_num_seqs=None)
    flags: list[str] = []
    for name, value in fields.items():
        if name != "max_num_seqs" and value != defaults.get(name):
            flags += engine_flag(name, value)
    return flags


# ---------------------------------------------------------------- rendering


def phase_rows(result: TuneResult) -> tuple[list[str], list[str]]:
    """(rows with a value in some column, rows with none) in the phase table's order."""
    names: list[str] = []
    for c in result.columns:
        names += [n for n in c.phases if n not in names]
    ran = [n for n in names if any(c.phases.get(n) is not None for c in result.columns if c.ok)]
    return ran, [n for n in names if n not in ran]


def cell_reason(error: str) -> str:
    """The gist of a start-up error for a table cell: no stage/exception prefixes, the first clause only."""
    text = re.sub(r"^(the one profiling start failed: )?(start-up (would )?fail(ed)? in \w+: )?(\w+: )?", "", error)
    cut = min((i for i in (text.find(sep) for sep in ("; ", ": ", ". ", " (")) if i > 0), default=len(text))
    return short(text[:cut], 70)


def _cell(column: Column, row: str) -> Cell:
    if not column.ok:
        return Missing(cell_reason(column.error or "start-up failed"))
    if row == "runs (n)":
        return f"{column.n}" + (f" ({len(column.failures)} failed)" if column.failures else "")
    if row == "KV blocks":
        return column.kv_blocks if column.kv_blocks is not None else Missing("not reported")
    if row == "token capacity":
        return column.token_capacity if column.token_capacity is not None else Missing("not reported")
    if row == "max concurrency":
        mc = column.max_concurrency
        return fmt_num(mc) if mc is not None else Missing("not reported")
    values = column.values(row)
    if not values:
        return Missing(column.reasons.get(row) or "not in the report")
    return fmt_spread(values, 2) if len(values) > 1 else fmt_num(values[0], 2)


def render_table(result: TuneResult) -> str:
    ran, _ = phase_rows(result)
    head = ["Metric \\ max-model-len", *(str(c.length) for c in result.columns)]
    rows: list[list[Cell]] = [[row, *(_cell(c, row) for c in result.columns)] for row in ("runs (n)", *ran, *KV_ROWS)]
    return markdown_table(head, rows)


def render_markdown(result: TuneResult, argv: list[str] | None = None) -> str:
    from .machine import report_header

    cfg = result.config
    title = "max-model-len sweep" if result.mode == "sweep" else "max-model-len plan (predicted, one start-up)"
    parts = [report_header(f"Tune: {title}", argv)]
    if result.mode == "sweep":
        parts.append(
            f"{cfg.repeats} pass(es) over the lengths, one `glowplug startup` per length per pass, each in a fresh "
            "process, all sharing one cache directory. Phases in seconds: a cell is the median (min–max) over the "
            "starts of that length (`runs (n)` says how many reached READY; one value where n=1). The KV rows are "
            f"the median over the same starts. The model allows {result.limit} positions."
        )
    else:
        how = (
            f"Predicted from one start-up at max-model-len {result.measured_length} (no restarts). KV rows: "
            "`plan_kv_cache` (engine/kv_sizing.py) per length"
        )
        if result.budget_bytes is not None:
            how += f" with the measured budget of {result.budget_bytes:,} bytes"
            how += f" and {result.bytes_per_token:,} bytes/token"
        how += (
            f" (blocks = budget // (bytes/token x {cfg.block_size})). Phases: copied from that start, since no stage's "
            "work depends on max-model-len; in particular the KV profile is keyed without max-model-len, so a sweep "
            "profiles once (its first length, on a cold cache) and hits at every other length. "
            f"The model allows {result.limit} positions."
        )
        parts.append(how)
    parts += ["", render_table(result), ""]
    _, never = phase_rows(result)
    if never:
        reasons = {n: next((c.reasons.get(n) for c in result.columns if c.reasons.get(n)), "no value") for n in never}
        parts += ["Phases that ran at no length: " + ", ".join(f"{n} ({r})" for n, r in reasons.items()) + ".", ""]
    failed = [c for c in result.columns if not c.ok]
    if failed:
        parts += ["Lengths that cannot start:", ""] + [f"- {c.length}: {c.error}" for c in failed] + [""]
    parts += [
        "max concurrency = KV blocks / ceil(max-model-len / block size): full-length sequences the cache holds "
        "at once.",
        "",
    ]
    parts += [
        "KV blocks: the cache's blocks after profiling; token capacity = KV blocks x block size "
        f"({cfg.block_size}): tokens the cache holds at once.",
        "",
    ]
    if result.mode == "sweep" and any(c.ok for c in result.columns):
        from .vllm_startup_rows import definitions_text

        parts += [
            "## Beside seed 004 (vLLM start-up per max-model-len)",
            "",
            seed_table(result),
            "",
            definitions_text(),
            "",
        ]
    if result.mode == "sweep" and cfg.plots and any(c.ok for c in result.columns):
        parts += [
            "![KV capacity against max-model-len](tune_kv_capacity.png) KV capacity (token capacity, and "
            "max concurrent full-length sequences) against max-model-len: median over the starts per length, "
            "error bars min–max, n in the legend.",
            "",
        ]
    rec = recommend(result)
    if rec is not None:
        parts += [f"## Recommendation for --min-concurrency {rec.min_concurrency}", "", rec.text, ""]
    return "\n".join(parts)


def seed_maps(column: Column) -> list[dict[str, float | None]]:
    """A length's starts as seed 004's rows (profiling/bench/vllm_startup_rows.py)."""
    from .vllm_startup_rows import default_leaves, map_phases

    return [map_phases(p, list(column.leaves) or default_leaves(p)) for p in column.samples]


def seed_table(result: TuneResult) -> str:
    from .vllm_startup_rows import per_length_table

    return per_length_table({c.length: seed_maps(c) for c in result.columns if c.ok})


def result_dict(result: TuneResult) -> dict[str, Any]:
    rec = recommend(result)
    return {
        "config": result.config.model_dump(mode="json"),
        "mode": result.mode,
        "model_limit": result.limit,
        "measured_length": result.measured_length,
        "budget_bytes": result.budget_bytes,
        "bytes_per_token": result.bytes_per_token,
        "columns": [
            {
                "max_model_len": c.length,
                "ok": c.ok,
                "error": c.error,
                "n": c.n,
                "failures": c.failures,
                "phases_median": c.phases,
                "reasons": c.reasons,
                "phases_per_run": c.samples,
                "kv_blocks": c.kv_blocks,
                "kv_blocks_per_run": c.blocks_samples,
                "token_capacity": c.token_capacity,
                "max_concurrency": c.max_concurrency,
                "seed_004_per_run": seed_maps(c) if c.ok else [],
            }
            for c in result.columns
        ],
        "start_reports": result.start_reports,
        "recommendation": None
        if rec is None
        else {"max_model_len": rec.length, "exact_bound": rec.exact_bound, "flags": rec.flags, "text": rec.text},
    }


def write_reports(result: TuneResult, argv: list[str] | None = None) -> list[Path]:
    out = prepare_out_dir(result.config.out_dir)
    stem = "tune" if result.mode == "sweep" else "tune-plan"
    md, js = out / f"{stem}.md", out / f"{stem}.json"
    md.write_text(render_markdown(result, argv))
    write_json(js, result_dict(result))
    written = [md, js]
    ok = [c for c in result.columns if c.ok]
    # A plan's phase columns are copies of one start: a stacked plot of them would be identical bars.
    if result.config.plots and ok and result.mode == "sweep":
        from .plots import plot_kv_capacity, plot_phase_stack

        leaves = list(dict.fromkeys(n for c in ok for n in c.leaves))
        stacks = {n: [c.phases.get(n) for c in ok] for n in leaves}
        cfg = result.config
        ns = sorted({c.n for c in ok})
        n_text = f"n={'/'.join(map(str, ns))} warm-model starts per length"
        title = (
            f"Start-up phases per max-model-len: {Path(cfg.model).name}, quantization {cfg.quantization}, "
            f"--dtype {cfg.dtype}; bars: median own time per phase over {n_text}; tick: median time to READY, "
            "error bar its min–max"
        )
        ready = [c.values("actual_total_time") for c in ok]
        written.append(
            plot_phase_stack(
                [str(c.length) for c in ok],
                stacks,
                out / f"{stem}_phases.png",
                title=title,
                xlabel="max-model-len",
                totals_label="time to READY (median)",
                totals=[_median(v) if v else 0.0 for v in ready],
                total_spread=[(min(v), max(v)) if v else (0.0, 0.0) for v in ready],
            )
        )
        written.append(
            plot_kv_capacity(
                {Path(cfg.model).name: kv_points(ok)},
                out / f"{stem}_kv_capacity.png",
                title=f"KV capacity per max-model-len: {Path(cfg.model).name}, quantization {cfg.quantization}, "
                f"block size {cfg.block_size}",
            )
        )
    return written


def kv_points(columns: list[Column]) -> list[tuple[int, list[float], list[float]]]:
    """Per length: (max-model-len, token capacity per start, max concurrent full-length sequences per start)."""
    out = []
    for c in columns:
        if c.block_size is None:
            continue
        per_seq = -(-c.length // c.block_size)
        out.append(
            (c.length, [float(b * c.block_size) for b in c.blocks_samples], [b / per_seq for b in c.blocks_samples])
        )
    return out


def main(cfg: TuneMaxModelLenConfig, argv: list[str] | None = None) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    result = run_tune(cfg, progress=lambda msg: err.print(msg, markup=False))
    paths = write_reports(result, argv)
    print(render_markdown(result, argv))  # plain Markdown: a terminal-fitted table would truncate numbers
    rec = recommend(result)
    if rec is not None and rec.flags:
        print(" ".join(rec.flags))  # last line: the flags alone, for scripts
    err.print("wrote " + ", ".join(map(str, paths)), markup=False)
    return 0 if any(c.ok for c in result.columns) else 1


def register(subparsers: Any, add_model_flags: AddModelFlags) -> Any:
    return add_command(
        subparsers,
        "max-model-len",
        help_text="Sweep (or --plan) max-model-len: start-up phases, KV blocks, capacity, max concurrency.",
        description=__doc__,
        config_cls=TuneMaxModelLenConfig,
        add_model_flags=add_model_flags,
        runner=main,
    )
