"""`glowplug bench startup`: N cold and N warm start-ups, each `glowplug startup` in a fresh process, with the
per-phase median and spread (min-max) and the time to READY, a stacked plot in pipeline order, starts from a
ready-engine bundle, the first ETA against the actual time, and the cost of tracing (the same warm start exporting
spans to a real OTLP receiver, and exporting nothing).

cold    every run gets its own empty cache directory: model conversion, compile cache and KV profile all miss.
warm    every run reuses the cache directory the last cold run filled: whatever is cached, hits.
bundle  `glowplug bundle create` once (timed against the cold starts), then N starts with `--bundle`, each into
        an empty cache directory, each right after a warm start: the ratio bundle / warm is taken per pair.
eta     one more cold start after the warm ones, in the warm cache directory emptied of everything but the
        start-up profile ("a cold start after a warm one"), for its first ETA.
otlp    N more warm starts with OTEL_EXPORTER_OTLP_ENDPOINT set to a receiver in this process, alternated with N
        warm starts without it, so drift of the machine hits both alike.
--predict       before every start, `glowplug startup --predict-only` in the same cache dir: the report sets what
                was predicted before starting, the first ETA of the start and its READY side by side, phase by
                phase for the first cold and the first warm start.
--seed-profile  a cache dir (or its startup_profile folder) whose recorded starts are copied into every empty cache
                dir before its start: the start-up model is then fitted on them (e.g. the default model's starts
                when benchmarking another model's first start).
--poll-serve    after the warm starts, one `glowplug serve` in the warm cache dir, `GET /startup` every 0.2 s until
                READY: every poll must name a running stage, its ETA within 30% of the time left
                (profiling/bench/startup_poll.py).
--save-baseline FILE  the cold and warm starts' phases (median and spread) as the baseline `glowplug startup
                --baseline FILE` gates a later start with.
Every target gets a verdict on its worst run (the Verdicts section, and startup.verdicts.json beside the report).
The rows are the phase table's (see profiling/phases.py). Stages may overlap: leaves + unattributed - overlap is
the time to READY (`actual_total_time`, process creation -> READY). A phase that did not run in a run (skipped)
has no sample from it; its row says why and over how many runs its statistics are taken.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from glowplug.engine.config import Quantization
from glowplug.profiling.names import Attr

from .cli_support import AddModelFlags, BenchEngineFields, add_command, check_path, prepare_out_dir, write_json
from .startup_poll import ServePoll, poll_serve, poll_text, poll_verdicts
from .startup_runs import CACHE_ENV, READY_ROW, StartupRun, failure_reason, run_prediction, short
from .startup_runs import run_startup as _run_startup
from .stats import PERCENTILE_METHOD, Summary, summarize
from .tables import Cell, Missing, fmt_num, markdown_table

# GLOWPLUG_MAX_CPU_ISA's values (base/machine.py ISA_LEVELS), so a wrong --bundle-isa-cap fails before any run.
IsaLevel = Literal["portable", "avx2", "avx512", "avx512_bf16", "amx"]
Mode = Literal["cold", "warm", "bundle", "bundle_isa_capped", "cold_after_warm", "otlp_off", "otlp_on"]
EXTRA_MODES: tuple[Mode, ...] = ("bundle", "bundle_isa_capped", "cold_after_warm")  # bundle and ETA runs
MODES: tuple[Mode, ...] = ("cold", "warm")  # the phase statistics (with "bundle" when it ran: `modes`)
TRACING_MODES: tuple[Mode, ...] = ("otlp_off", "otlp_on")  # the tracing-overhead comparison
TRACING_TARGET = 0.01  # the target: exporting spans costs at most 1% of the time to READY
# Issue 35's targets for a start from a bundle: time to READY at most 1.2x the warm start (per pair), the file at
# most the model as stored + 20 MB, `bundle create` at most the cold start + 5 s; the first ETA within 25%.
BUNDLE_START_TARGET = 1.2
BUNDLE_EXTRA_BYTES = 20_000_000
BUNDLE_CREATE_EXTRA_S = 5.0
ETA_TARGET = 0.25
# Issue 52's targets for the first ETA when no start with the same cache hits was recorded: the first (cold) start
# of a model within 30% of its READY, its first warm start (after one cold start) within 20%.
ETA_COLD_TARGET = 0.30
ETA_FIRST_WARM_TARGET = 0.20
Progress = Callable[[str], None]


# Each path flag: what must hold of the path, and the problem and its fix when it does not.
_PATH_CHECKS: dict[str, tuple[Callable[[Path], object], str]] = {
    "from_runs": (
        lambda v: runs_source(v) is not None,
        "--from-runs {v} is neither a startup.json nor a folder holding one (or cold-N.json / warm-N.json files); "
        "pass the --out-dir of an earlier bench startup run",
    ),
    "seed_profile": (
        lambda v: seed_profile_folder(v) is not None,
        "--seed-profile {v}: no startup_profile folder there; pass a GLOWPLUG_CACHE_DIR that recorded starts (or its "
        "startup_profile folder)",
    ),
    "compare_to": (
        Path.is_file,
        "--compare-to {v} is not a file; pass the startup.json of an earlier bench startup run",
    ),
}


class StartupBenchConfig(BenchEngineFields):
    # The engine's default (as stored: the default model's Q4_1 blocks run as int4), so the report times the start a
    # user gets without flags.
    quantization: Quantization = "auto"
    max_model_len: int | Literal["auto"] | None = Field(
        None, description="Passed to every start; unset = the engine's default."
    )
    max_num_seqs: int | None = Field(None, ge=1)
    runs: int = Field(3, ge=1, description="Cold starts, and as many warm starts.")
    timeout_s: float = Field(900.0, gt=0, description="Per start-up.")
    keep_caches: bool = Field(False, description="Keep the temporary cache directories (their paths are printed).")
    out_dir: Path = Field(Path("bench-startup"), description="Where startup.md/.json/.png go (relative to the cwd).")
    plots: bool = True
    tracing_overhead: bool = Field(True, description="Also run N warm starts with and N without OTLP export.")
    tracing_runs: int | None = Field(
        None, ge=1, description="Pairs of warm starts (without, then with export) for the overhead; unset = --runs."
    )
    compare_to: Path | None = Field(
        None,
        description="A previous run's startup.json: adds startup_before_after.png, the median phases of its "
        "cold and warm starts beside this run's (and this run's bundle start).",
    )
    bundle_isa_cap: IsaLevel | None = Field(
        None,
        description="Also one start from the bundle under GLOWPLUG_MAX_CPU_ISA=this level (e.g. avx2), into an "
        "empty cache dir: which entries it rebuilds, and what their rows say.",
    )
    bundle: bool = Field(
        True,
        description="Also make a bundle and run N starts from it, each into an empty cache dir, paired with "
        "the warm starts; and one cold start after a warm one (cache emptied) for its ETA.",
    )
    predict: bool = Field(
        False,
        description="Before every start, run `glowplug startup --predict-only` in its cache dir: the report "
        "shows predicted against actual for every start, phase by phase for the first cold and warm ones.",
    )
    seed_profile: Path | None = Field(
        None,
        description="A cache dir (or its startup_profile folder) whose recorded starts are copied into each "
        "empty cache dir before its start, so the start-up model is fitted on them (another model's starts).",
    )
    poll_serve: bool = Field(
        False,
        description="After the warm starts, one `glowplug serve` in the warm cache dir polled on /startup every "
        "0.2 s until READY: does every poll name a running stage, and is its ETA within 30% of the time left?",
    )
    save_baseline: Path | None = Field(
        None,
        description="Write the cold and warm starts' phases (median and spread) to this file: the baseline "
        "`glowplug startup --baseline FILE` gates a later start with.",
    )

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks per start (--tensor-parallel-size): every rank's spans go into one report, and "
        "the last warm start's trace is drawn one lane per rank (rank_lanes.png).",
    )
    from_runs: Path | None = Field(
        None,
        description="Run nothing: render the report from an earlier run's startup.json (a file, or the folder "
        "holding it: every start's own report is in it, and a run stopped early leaves the starts it finished), or "
        "from the per-start JSON files (cold-N.json, warm-N.json, ...) that older versions left in a folder, e.g. "
        "one made on another machine.",
    )

    @field_validator("from_runs", "seed_profile", "compare_to")
    @classmethod
    def _path_holds(cls, v: Path | None, info: ValidationInfo) -> Path | None:
        # Checked when the flags are read, not after the runs (the --compare-to plot is drawn once every start is done).
        ok, problem = _PATH_CHECKS[str(info.field_name)]
        return check_path(v, ok, problem)

    def startup_args(self) -> list[str]:
        argv = self.startup_argv(
            quantization=self.quantization, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs
        )
        return argv + (
            ["--tensor-parallel-size", str(self.tensor_parallel_size)] if self.tensor_parallel_size > 1 else []
        )


@dataclass(frozen=True)
class BundleMade:
    """`glowplug bundle create` as the benchmark ran it: its wall time, the file's size and the model's."""

    wall_s: float
    size: int
    model_bytes: int
    error: str | None = None


@dataclass
class StartupBenchResult:
    config: StartupBenchConfig
    runs: dict[Mode, list[StartupRun]]
    bundle: BundleMade | None = None
    poll: ServePoll | None = None  # --poll-serve


LANES_TRACE = "warm-trace.json"
REPORT_JSON = "startup.json"


def seed_profile_folder(path: Path) -> Path | None:
    """The startup_profile folder `path` names (the folder itself, or a cache dir holding one), else None."""
    for folder in (path, path / "startup_profile"):
        if folder.is_dir() and folder.name == "startup_profile":
            return folder
    return None


def _seed(cfg: StartupBenchConfig, cache: Path) -> None:
    """Copy the seed profile's recorded starts into an empty cache dir (--seed-profile)."""
    if cfg.seed_profile is None:
        return
    source = seed_profile_folder(cfg.seed_profile)
    if source is not None:
        shutil.copytree(source, cache / "startup_profile", dirs_exist_ok=True)


def runs_source(path: Path) -> Path | None:
    """Where --from-runs reads: the startup.json (given, or in the folder), else a folder of per-start files from
    an older version; None when `path` is neither."""
    import json

    if path.is_file():
        return path if path.suffix == ".json" else None
    legacy = path.is_dir() and (any(path.glob("cold-*.json")) or any(path.glob("warm-*.json")))
    report = path / REPORT_JSON
    if report.is_file():
        # An older startup.json kept only each start's phases; its folder's per-start files have the whole reports.
        runs = json.loads(report.read_text()).get("runs") or [{}]
        if not legacy or "report" in runs[0]:
            return report
    return path if legacy else None  # the last warm start's Chrome/Perfetto trace, under tensor parallelism


def modes(result: StartupBenchResult) -> tuple[Mode, ...]:
    """The modes with phase statistics in this result: cold, warm, and bundle when it ran."""
    return (*MODES, "bundle") if result.runs.get("bundle") else MODES


def _make_bundle(cfg: StartupBenchConfig, args: list[str], path: Path, cache: Path) -> BundleMade:
    import os
    import subprocess
    import sys
    import time

    from glowplug.engine.bundle import model_files

    cmd = [sys.executable, "-m", "glowplug.cli", "bundle", "create", *args, "--out", str(path), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd,
        env={**os.environ, CACHE_ENV: str(cache)},
        capture_output=True,
        text=True,
        timeout=cfg.timeout_s * 3,
        check=False,
    )
    wall = time.perf_counter() - t0
    model_bytes = sum(f.stat().st_size for f in model_files(str(cfg.model)))
    if proc.returncode != 0 or not path.is_file():
        return BundleMade(wall, 0, model_bytes, failure_reason(proc.stderr, proc.returncode))
    return BundleMade(wall, path.stat().st_size, model_bytes)


def run_startup_bench(cfg: StartupBenchConfig, progress: Progress | None = None) -> StartupBenchResult:
    say = progress or (lambda _msg: None)
    out = prepare_out_dir(cfg.out_dir)
    from .machine import compile_package_bytecode

    compiled = compile_package_bytecode()
    if compiled:
        say(f"byte-compiled {compiled} of the package's modules first, as an installed wheel has them")
    root = Path(tempfile.mkdtemp(prefix="glowplug-startup-bench-"))
    args = cfg.startup_args()
    runs: dict[Mode, list[StartupRun]] = {m: [] for m in (*MODES, *EXTRA_MODES, *TRACING_MODES)}
    warm_dir: Path | None = None
    made: BundleMade | None = None
    bundle_file = root / "bench.glowplug"
    reports = root / "reports"  # each start's own --report-out: read back into startup.json, never left in `out`
    reports.mkdir()

    def run_startup(label: str, start_args: list[str], report: Path, **kw: Any) -> StartupRun:
        prediction = None
        if cfg.predict and not label.startswith("otlp"):  # the tracing pairs time export, not the ETA
            prediction = run_prediction(
                start_args, reports / f"predict-{report.name}", cache_dir=kw.get("cache_dir"), env=kw.get("env")
            )
        run = _run_startup(label, start_args, reports / report.name, **kw)
        run.prediction = prediction
        # A checkpoint after every start: a run stopped early still leaves its finished starts in startup.json.
        write_json(
            out / REPORT_JSON,
            {
                "partial": True,
                "config": cfg.model_dump(mode="json"),
                "runs": [*runs_list(runs), run_entry(_mode_of(label), run)],
            },
        )
        return run

    try:
        for i in range(1, cfg.runs + 1):
            cache = root / f"cold-{i}"
            cache.mkdir()
            _seed(cfg, cache)
            say(f"cold start {i}/{cfg.runs} (empty cache {cache})")
            run = run_startup(f"cold {i}", args, out / f"cold-{i}.json", cache_dir=cache, timeout_s=cfg.timeout_s)
            runs["cold"].append(run)
            if run.ok:
                if warm_dir is not None and not cfg.keep_caches:
                    shutil.rmtree(warm_dir, ignore_errors=True)
                warm_dir = cache  # the newest filled cache primes the warm runs
            elif not cfg.keep_caches:
                shutil.rmtree(cache, ignore_errors=True)
        if cfg.bundle and warm_dir is not None:
            say(f"glowplug bundle create ({bundle_file})")
            made = _make_bundle(cfg, args, bundle_file, root / "bundle-create-cache")
        for i in range(1, cfg.runs + 1):
            if warm_dir is None:
                runs["warm"].append(StartupRun(f"warm {i}", -1, 0.0, error="no cold start succeeded to fill a cache"))
                continue
            say(f"warm start {i}/{cfg.runs} (cache {warm_dir})")
            # Under tensor parallelism the last warm start also writes its trace, which the report draws per rank.
            lanes = ["--chrome-trace", str(out / LANES_TRACE)] if cfg.tensor_parallel_size > 1 and i == cfg.runs else []
            runs["warm"].append(
                run_startup(
                    f"warm {i}", [*args, *lanes], out / f"warm-{i}.json", cache_dir=warm_dir, timeout_s=cfg.timeout_s
                )
            )
            if made is not None and made.error is None:
                fresh = root / f"bundle-{i}"
                say(f"start from the bundle {i}/{cfg.runs} (empty cache {fresh})")
                runs["bundle"].append(
                    run_startup(
                        f"bundle {i}",
                        ["--bundle", str(bundle_file), *args],
                        out / f"bundle-{i}.json",
                        cache_dir=fresh,
                        timeout_s=cfg.timeout_s,
                    )
                )
                shutil.rmtree(fresh, ignore_errors=True)
        if made is not None and made.error is None and cfg.bundle_isa_cap:
            import os

            fresh = root / "bundle-capped"
            say(f"start from the bundle under GLOWPLUG_MAX_CPU_ISA={cfg.bundle_isa_cap} (empty cache {fresh})")
            runs["bundle_isa_capped"].append(
                run_startup(
                    f"bundle, GLOWPLUG_MAX_CPU_ISA={cfg.bundle_isa_cap}",
                    ["--bundle", str(bundle_file), *args],
                    out / "bundle-isa-capped.json",
                    cache_dir=fresh,
                    timeout_s=cfg.timeout_s,
                    env={**os.environ, "GLOWPLUG_MAX_CPU_ISA": cfg.bundle_isa_cap},
                )
            )
        if cfg.bundle and warm_dir is not None:
            emptied = root / "cold-after-warm"
            shutil.copytree(warm_dir / "startup_profile", emptied / "startup_profile")
            say(f"cold start after a warm one, for its ETA (cache {emptied}: only the start-up profile)")
            runs["cold_after_warm"].append(
                run_startup(
                    "cold after warm", args, out / "cold-after-warm.json", cache_dir=emptied, timeout_s=cfg.timeout_s
                )
            )
        if cfg.tracing_overhead and warm_dir is not None:
            _tracing_runs(cfg, args, out, warm_dir, runs, say, run_startup)
        polled = None
        if cfg.poll_serve and warm_dir is not None:
            say(f"glowplug serve in the warm cache, /startup polled every 0.2 s until READY (cache {warm_dir})")
            polled = poll_serve(args, warm_dir, cfg.timeout_s)
    finally:
        if not cfg.keep_caches:
            shutil.rmtree(root, ignore_errors=True)
    return StartupBenchResult(cfg, runs, made, polled)


def _mode_of(label: str) -> str:
    """A start's mode from its label ("cold 2", "otlp_off 1", "cold after warm", "bundle, GLOWPLUG_MAX_CPU_ISA=..")."""
    if label.startswith("bundle,"):
        return "bundle_isa_capped"
    if label == "cold after warm":
        return "cold_after_warm"
    return label.split(" ")[0]


def run_entry(mode: str, r: StartupRun) -> dict[str, Any]:
    """One start as startup.json holds it: its outcome and its whole --report-out JSON (what the per-start file
    held), so --from-runs can re-render everything from startup.json alone."""
    return {
        "mode": mode,
        "label": r.label,
        "ok": r.ok,
        "returncode": r.returncode,
        "wall_s": r.wall_s,
        "error": r.error,
        "phases": r.phases,
        "reasons": r.reasons,
        "cache_hits": r.cache_hits(),
        "report": r.report,
        "prediction": r.prediction,
    }


def runs_list(runs: dict[Mode, list[StartupRun]]) -> list[dict[str, Any]]:
    return [run_entry(m, r) for m in (*MODES, *EXTRA_MODES, *TRACING_MODES) for r in runs.get(m, [])]


def _tracing_runs(
    cfg: StartupBenchConfig,
    args: list[str],
    out: Path,
    cache: Path,
    runs: dict[Mode, list[StartupRun]],
    say: Progress,
    run_startup: Callable[..., StartupRun],
) -> None:
    """Alternate warm starts without and with OTLP export to a receiver that decodes every request."""
    import os

    from .otlp_sink import OtlpSink

    quiet = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with OtlpSink() as sink:
        exporting = {
            **quiet,
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
        pairs = cfg.tracing_runs or cfg.runs
        for i in range(1, pairs + 1):
            for mode, env in (("otlp_off", quiet), ("otlp_on", exporting)):
                say(f"{mode} start {i}/{pairs}")
                before = sink.spans
                run = run_startup(
                    f"{mode} {i}",
                    args,
                    out / f"{mode}-{i}.json",
                    cache_dir=cache,
                    timeout_s=cfg.timeout_s,
                    env={**env, CACHE_ENV: str(cache)},
                )
                if mode == "otlp_on" and run.ok and sink.spans == before:
                    run.error = "the OTLP receiver got no spans from this start"
                runs[mode].append(run)  # type: ignore[index]


@dataclass(frozen=True)
class TracingOverhead:
    """Export's cost, from paired starts: pair i is a start without export and the start right after it with
    export, so slow drifts of the machine cancel within a pair. `relative` is the median of the pairs' relative
    differences; `ci_low`/`ci_high` bound it (95 %, bootstrap over the pairs, fixed seed)."""

    off_p50: float
    on_p50: float
    off_spread: float
    on_spread: float
    runs: int
    relative: float
    ci_low: float | None
    ci_high: float | None

    @property
    def resolvable(self) -> bool:
        """Whether the runs can place the overhead on one side of the target."""
        return (
            self.ci_low is not None
            and self.ci_high is not None
            and (self.ci_high <= TRACING_TARGET or self.ci_low > TRACING_TARGET)
        )


BOOTSTRAP_RESAMPLES = 10_000


def paired_median_ci(diffs: list[float], level: float = 0.95, seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of the median of `diffs`; None below 3 pairs (too few to resample)."""
    import numpy as np

    if len(diffs) < 3:
        return None
    rng = np.random.default_rng(seed)
    d = np.asarray(diffs, dtype=float)
    medians = np.median(d[rng.integers(0, len(d), size=(BOOTSTRAP_RESAMPLES, len(d)))], axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def tracing_overhead(result: StartupBenchResult) -> TracingOverhead | None:
    import statistics

    stats = [phase_stat(result.runs.get(m, []), READY_ROW).summary for m in TRACING_MODES]
    off, on = stats
    if off is None or on is None:
        return None
    diffs = []
    for a, b in zip(result.runs.get("otlp_off", []), result.runs.get("otlp_on", [])):
        ta, tb = a.phases.get(READY_ROW) if a.ok else None, b.phases.get(READY_ROW) if b.ok else None
        if ta and tb:
            diffs.append((tb - ta) / ta)
    if not diffs:
        return None
    ci = paired_median_ci(diffs)
    return TracingOverhead(
        off.p50, on.p50, off.max - off.min, on.max - on.min, len(diffs), statistics.median(diffs), *(ci or (None, None))
    )


# ---------------------------------------------------------------- statistics


def row_names(result: StartupBenchResult) -> list[str]:
    """Rows in the phase table's display order, as the reports wrote them (union over all runs)."""
    names: list[str] = []
    for mode in modes(result):
        for run in result.runs[mode]:
            names += [n for n in run.phases if n not in names]
    return names


@dataclass(frozen=True)
class PhaseStat:
    """One phase over one mode's runs: statistics over the runs where it ran, and why it did not in the others."""

    summary: Summary | None
    reasons: tuple[str, ...]  # distinct reasons it has no value in some runs
    missing: int  # successful runs without a value
    ok_runs: int

    @property
    def why(self) -> str:
        if self.reasons:
            return "; ".join(self.reasons)
        return "no samples" if self.ok_runs else "no successful start"

    @property
    def note(self) -> str | None:
        if not self.ok_runs:
            return "no successful start"
        return f"{self.why} in {self.missing} of {self.ok_runs} runs" if self.missing else None


def phase_stat(runs: list[StartupRun], row: str) -> PhaseStat:
    ok = [r for r in runs if r.ok]
    values = [v for r in ok if (v := r.phases.get(row)) is not None]
    reasons = tuple(sorted({r.reasons.get(row) or "not in the report" for r in ok if r.phases.get(row) is None}))
    return PhaseStat(summarize(values) if values else None, reasons, len(ok) - len(values), len(ok))


def cache_hit_counts(runs: list[StartupRun]) -> dict[str, tuple[int, int]]:
    counts: dict[str, tuple[int, int]] = {}
    for run in (r for r in runs if r.ok):
        for row, hit in run.cache_hits().items():
            hits, total = counts.get(row, (0, 0))
            counts[row] = (hits + int(hit), total + 1)
    return counts


# ---------------------------------------------------------------- rendering


STATS = ("p50", "min", "max")  # median and spread: with N = 3 a p90 or p99 is only the largest run again


def _phase_table(result: StartupBenchResult) -> tuple[str, list[str]]:
    """Phases as rows, cold and warm statistics side by side; also the phases that ran in neither (with why)."""
    rows: list[list[Cell]] = []
    never: list[str] = []
    for row in row_names(result):
        per_mode = {m: phase_stat(result.runs[m], row) for m in modes(result)}
        if all(p.summary is None for p in per_mode.values()):
            never.append(f"{row} ({'; '.join(sorted({p.why for p in per_mode.values()}))})")
            continue
        cells: list[Cell] = [f"**time to READY** ({row})" if row == READY_ROW else row]
        notes = []
        for mode, stat in per_mode.items():
            if stat.summary is None:
                cells += [Missing(stat.why)] * len(STATS)
            else:
                cells += [fmt_num(getattr(stat.summary, k), 3) for k in STATS]
            if stat.note:
                notes.append(f"{mode}: {stat.note}")
        if row == "floor":
            notes += _floor_notes(result)
        rows.append([*cells, "; ".join(notes) or "ran in every run"])
    head = ["Phase", *(f"{m} {k.replace('p50', 'median')} (s)" for m in modes(result) for k in STATS), "Note"]
    return markdown_table(head, rows, ["l"] + ["r"] * len(modes(result)) * len(STATS) + ["l"]), never


def _floor_notes(result: StartupBenchResult) -> list[str]:
    """The floor's figures per kind of start (medians over its starts): actual/floor, and what the floor is made of
    (weights in MB = 1e6 bytes, read probe in GB/s = 1e9 bytes/s, `import torch` in s)."""
    import statistics

    out = []
    for mode in modes(result):
        attrs = [a for r in result.runs[mode] if r.ok and (a := r.report.get("attributes", {}).get("floor"))]
        ratios = [float(a["actual/floor"]) for a in attrs if a.get("actual/floor") is not None]
        if not ratios:
            continue
        med = lambda k, attrs=attrs: statistics.median(float(a[k]) for a in attrs)  # noqa: E731
        out.append(
            f"{mode}: actual/floor {statistics.median(ratios):.2f}x (floor = "
            f"{med(Attr.FLOOR_WEIGHTS_BYTES) / 1e6:.0f} MB at {med(Attr.FLOOR_READ_GBPS):.1f} "
            f"GB/s + import torch {med(Attr.FLOOR_IMPORT_TORCH_S):.2f} s)"
        )
    return out


AGGREGATES_TEXT = """How to read the rows (do not add them up blindly):

- **Leaves** (process_start, imports, one row per stage, unattributed) are each stage's own time, from its span.
- **Aggregates** (shown as `Σ`: model_loading, torch.compile, init_engine) are sums of leaves listed in their note.
  Every leaf is in at most one aggregate. Never add an aggregate to its leaves or to another aggregate.
- **overlap** is how much of the stages' own time ran at the same time as another stage. It is the sum of their
  own times minus the wall time they covered. Leaves + unattributed - overlap = actual_total_time.
- **critical_path** is the longest chain of stages that waited on each other. No overlap makes a start faster than
  that. It is not a part of the sum.
- **total_time** is the sum of the stage spans. It is more than the wall time when stages overlap.
  **actual_total_time** is the wall time from process creation to READY: the time to READY.
- **floor** is the weights bytes divided by a read-bandwidth probe, plus `import torch`: the least a start could
  take. Its note gives actual/floor (time to READY / floor) per kind of start, median over its starts, and the
  floor's parts (MB = 1e6 bytes, GB/s = 1e9 bytes/s).
- In the plot, each bar stacks the leaves in pipeline order. Where stages overlapped, the stack is taller than the
  black tick, which marks the time to READY."""


def _seed_text(result: StartupBenchResult) -> str:
    from .vllm_startup_rows import comparison_table, definitions_text

    table = comparison_table({m: seed_maps(result.runs[m]) for m in modes(result)})
    return (
        f"{table}\n\n{definitions_text()} glowplug's columns are this report's starts (median (min–max, n) "
        "over the starts of each kind); the seed's are vLLM's on a GPU with 4B and 13B models, so compare the "
        "shape of the start (which rows dominate, how much the total leaves out), not the seconds."
    )


def _tracing_text(result: StartupBenchResult) -> str:
    if not result.config.tracing_overhead:
        return "Not measured (--no-tracing-overhead)."
    overhead = tracing_overhead(result)
    if overhead is None:
        return "Not measured: a warm start with or without export failed (see Runs)."
    t = f"{100 * TRACING_TARGET:.0f}%"
    if overhead.ci_low is None or overhead.ci_high is None:
        verdict = (
            f"Too few pairs ({overhead.runs}) for an interval, so the runs cannot place it against the {t} "
            "target; use --tracing-runs 3 or more."
        )
    else:
        ci = f"95% interval {100 * overhead.ci_low:+.2f}% to {100 * overhead.ci_high:+.2f}%"
        if overhead.ci_high <= TRACING_TARGET:
            verdict = f"The {ci} lies at or under the {t} target: **within target**."
        elif overhead.ci_low > TRACING_TARGET:
            verdict = f"The {ci} lies above the {t} target: **over target**."
        else:
            verdict = (
                f"The {ci} contains the {t} target, so these runs cannot tell; more pairs (--tracing-runs) narrow it."
            )
    table = markdown_table(
        ["Export", "median time to READY (s)", "spread max-min (s)", "runs"],
        [
            ["none", fmt_num(overhead.off_p50, 3), fmt_num(overhead.off_spread, 3), overhead.runs],
            [
                "OTLP/HTTP to a local receiver",
                fmt_num(overhead.on_p50, 3),
                fmt_num(overhead.on_spread, 3),
                overhead.runs,
            ],
        ],
    )
    return (
        f"Warm starts in {overhead.runs} pairs: a start without span export, then one exporting to a real "
        f"OTLP/HTTP receiver in the benchmark process. Export adds {100 * overhead.relative:+.2f}% to the time "
        f"to READY (median over the pairs of (with - without) / without). {verdict}\n\n{table}"
    )


def _runs_table(result: StartupBenchResult) -> str:
    rows: list[list[Cell]] = []
    for mode in (*MODES, *EXTRA_MODES, *TRACING_MODES):
        for run in result.runs.get(mode, []):
            if not run.ok:
                failed = Missing("start failed")
                rows.append([run.label, Missing(short(run.error or "failed")), failed, failed, failed])
                continue
            p = run.phases
            hits = run.cache_hits()
            hit_text = ", ".join(f"{k} {'hit' if v else 'miss'}" for k, v in hits.items()) or "no cache rows"
            rows.append(
                [
                    run.label,
                    fmt_num(p[READY_ROW] or 0, 3),
                    fmt_num(p.get("total_time") or 0, 3),
                    fmt_num(p.get("unattributed") or 0, 3),
                    hit_text,
                ]
            )
    return markdown_table(
        ["Run", "time to READY (s)", "total_time (s)", "unattributed (s)", "Caches"], rows, ["l", "r", "r", "r", "l"]
    )


def _ready(run: StartupRun) -> float | None:
    return run.phases.get(READY_ROW) if run.ok else None


def bundle_figures(result: StartupBenchResult) -> dict[str, Any]:
    """The bundle's targets, each with its figures: per pair (warm i, bundle i) the ratio of their times to READY
    (median and worst), the size over the model as stored, and `bundle create` against the median cold start."""
    out: dict[str, Any] = {}
    pairs = [(w, b) for w, b in zip(result.runs["warm"], result.runs.get("bundle", [])) if _ready(w) and _ready(b)]
    ratios = [_ready(b) / _ready(w) for w, b in pairs]  # type: ignore[operator]
    if ratios:
        ordered = sorted(ratios)
        out.update(
            pair_ratios=[round(r, 4) for r in ratios],
            ratio_median=round(ordered[len(ordered) // 2], 4),
            ratio_worst=round(ordered[-1], 4),
            ratio_pass=ordered[-1] <= BUNDLE_START_TARGET,
        )
    made = result.bundle
    if made is not None and made.error is None:
        out.update(
            extra_bytes=made.size - made.model_bytes, size_pass=made.size - made.model_bytes <= BUNDLE_EXTRA_BYTES
        )
        colds = sorted(v for r in result.runs["cold"] if (v := _ready(r)) is not None)
        if colds:
            cold = colds[len(colds) // 2]
            out.update(
                cold_median_s=cold,
                create_over_cold_s=round(made.wall_s - cold, 3),
                create_pass=made.wall_s <= cold + BUNDLE_CREATE_EXTRA_S,
            )
    return out


def _bundle_text(result: StartupBenchResult) -> str:
    made = result.bundle
    if made is None:
        return "Not measured (--no-bundle, or no cold start succeeded)."
    if made.error is not None:
        return f"`glowplug bundle create` failed: {made.error}"
    f = bundle_figures(result)
    verdict = lambda ok: "**PASS**" if ok else "**FAIL**"  # noqa: E731
    rows: list[list[Cell]] = [
        [
            "bundle size over the model as stored",
            f"{made.size / 1e6:.1f} MB - {made.model_bytes / 1e6:.1f} MB = {f['extra_bytes'] / 1e6:.1f} MB",
            f"<= {BUNDLE_EXTRA_BYTES / 1e6:.0f} MB",
            verdict(f["size_pass"]),
        ],
    ]
    if "create_pass" in f:
        rows.append(
            [
                "`bundle create` (wall, one run) - median cold start",
                f"{made.wall_s:.2f} - {f['cold_median_s']:.2f} = {f['create_over_cold_s']:+.2f} s",
                f"<= +{BUNDLE_CREATE_EXTRA_S:.0f} s",
                verdict(f["create_pass"]),
            ]
        )
    if "ratio_worst" in f:
        rows.append(
            [
                "start from the bundle / warm start, per pair",
                f"median {f['ratio_median']:.3f}x, worst {f['ratio_worst']:.3f}x "
                f"({', '.join(f'{r:.3f}' for r in f['pair_ratios'])})",
                f"worst <= {BUNDLE_START_TARGET:.1f}x",
                verdict(f["ratio_pass"]),
            ]
        )
    table = markdown_table(["Target", "Measured", "Target", "Verdict"], rows, ["l", "l", "l", "l"])
    text = (
        "One `glowplug bundle create` with the same flags (a cold and a warm start in a private cache dir, "
        "then the packing), then each start from the bundle goes into an empty cache dir right after warm "
        f"start i, and is divided by it.\n\n{table}"
    )
    capped = result.runs.get("bundle_isa_capped", [])
    if capped:
        text += "\n\n" + _capped_text(capped[0])
    return text


def _capped_text(run: StartupRun) -> str:
    """The ISA-capped start from the bundle: each cache row, hit or rebuilt, with its note."""
    if not run.ok:
        return f"Start from the bundle, {run.label}: failed: {run.error}"
    rows: list[list[Cell]] = []
    for row, hit in run.cache_hits().items():
        notes = run.report.get("notes", {}).get(row) or [run.reasons.get(row) or ("cache hit" if hit else "cache miss")]
        rows.append([row, "hit" if hit else "**rebuilt**", " ".join(str(n) for n in notes)])
    install = run.report.get("notes", {}).get("bundle_install", [""])
    table = markdown_table(["Row", "Cache", "Note"], rows, ["l", "l", "l"])
    return (
        f"Start from the bundle, {run.label}, into an empty cache dir: READY in "
        f"{run.phases.get(READY_ROW) or 0:.2f} s. bundle_install: {' '.join(map(str, install))}\n\n{table}"
    )


def eta_target(kind: str) -> float:
    """The first ETA's limit for a kind of start (issue 35's 25%; issue 52's 30% for a model's first, cold start,
    20% for its first warm start)."""
    if kind.startswith("cold (first"):
        return ETA_COLD_TARGET
    if kind == "warm after cold":
        return min(ETA_TARGET, ETA_FIRST_WARM_TARGET)
    return ETA_TARGET


def eta_figures(result: StartupBenchResult) -> list[dict[str, Any]]:
    """Each start's first ETA (at the end of the imports row; after the install for a bundle start) against its
    time to READY, by the kind of start it was, with that kind's target."""
    kinds: list[tuple[str, StartupRun]] = []
    seeded = result.config.seed_profile is not None
    cold_kind = "cold (first start, profile seeded)" if seeded else "cold (first start of the model)"
    kinds += [(cold_kind, r) for r in result.runs.get("cold", [])]
    for i, run in enumerate(result.runs["warm"]):
        kinds.append(("warm after cold" if i == 0 else "warm after warm", run))
    kinds += [("from a bundle into an empty cache", r) for r in result.runs.get("bundle", [])]
    kinds += [("cold after warm (cache emptied)", r) for r in result.runs.get("cold_after_warm", [])]
    out = []
    for kind, run in kinds:
        eta = run.attr(READY_ROW, Attr.ETA_FIRST_READY_S)
        actual = _ready(run)
        if actual is None:
            continue
        err = None if eta is None else float(eta) / actual - 1
        out.append(
            {
                "kind": kind,
                "run": run.label,
                "eta_s": eta,
                "actual_s": actual,
                "error": None if err is None else round(err, 4),
                "target": eta_target(kind),
                "basis": run.attr(READY_ROW, Attr.ETA_BASIS),
            }
        )
    return out


def prediction_figures(result: StartupBenchResult) -> list[dict[str, Any]]:
    """With --predict: every start's prediction made before it started (`--predict-only`), its first ETA and its
    READY, and how many phases each prediction took from recorded starts and from the start-up model."""
    out = []
    for mode in (*MODES, *EXTRA_MODES, *TRACING_MODES):
        for run in result.runs.get(mode, []):
            pred = run.prediction
            if pred is None:
                continue
            actual = _ready(run)
            ready = pred.get("ready_s")
            eta = run.attr(READY_ROW, Attr.ETA_FIRST_READY_S)
            phases = pred.get("phases") or {}
            eta_phases = json.loads(run.attr(READY_ROW, Attr.ETA_PHASES) or "{}")
            out.append(
                {
                    "run": run.label,
                    "mode": mode,
                    "actual_s": actual,
                    "predicted_s": ready,
                    "first_eta_s": eta,
                    "predict_error": None if actual is None or ready is None else round(ready / actual - 1, 4),
                    "eta_error": None if actual is None or eta is None else round(float(eta) / actual - 1, 4),
                    "error": pred.get("error"),
                    "command_s": pred.get("command_s"),
                    "recorded": sum(1 for p in phases.values() if p.get("kind") == "recorded"),
                    "modelled": sum(1 for p in phases.values() if p.get("kind") == "model"),
                    "phases": {
                        s: {
                            "predicted_s": p.get("seconds"),
                            "kind": p.get("kind"),
                            "basis": p.get("basis"),
                            "first_eta_s": (eta_phases.get(s) or {}).get("seconds"),
                            "actual_s": _stage_seconds(run, s),
                        }
                        for s, p in phases.items()
                    },
                    "before_s": pred.get("before_s"),
                    "actual_before_s": run.attr(READY_ROW, Attr.ETA_FIRST_AT_S),
                }
            )
    return out


def _stage_seconds(run: StartupRun, stage: str) -> float | None:
    """A stage's own seconds in a run's report: its row's, or for a stage booked to another row (graph_compile,
    graph_capture) that row's."""
    from glowplug.profiling.names import STAGE_ROWS

    phases = run.phases
    if stage == "graph_compile":
        values = [
            v for k in ("graph_compile_general_shape", "graph_compile_cached") if (v := phases.get(k)) is not None
        ]
        return values[0] if values else None
    return phases.get(STAGE_ROWS.get(stage, stage), phases.get(stage))


def _prediction_text(result: StartupBenchResult) -> str:
    figures = prediction_figures(result)
    if not figures:
        return "Not run (--predict makes it)."
    rows: list[list[Cell]] = []
    for f in figures:
        if f["error"] is not None or f["actual_s"] is None:
            rows.append(
                [
                    f["run"],
                    Missing(short(f["error"] or "the start failed")),
                    Missing("-"),
                    Missing("-"),
                    Missing("-"),
                    Missing("-"),
                    Missing("-"),
                ]
            )
            continue
        pe = Missing("no process-start figure") if f["predict_error"] is None else f"{100 * f['predict_error']:+.1f}%"
        ee = Missing("no ETA") if f["eta_error"] is None else f"{100 * f['eta_error']:+.1f}%"
        rows.append(
            [
                f["run"],
                Missing("no recorded process start") if f["predicted_s"] is None else fmt_num(f["predicted_s"], 3),
                fmt_num(float(f["first_eta_s"]), 3) if f["first_eta_s"] is not None else Missing("no ETA"),
                fmt_num(f["actual_s"], 3),
                pe,
                ee,
                f"{f['recorded']} recorded, {f['modelled']} model",
            ]
        )
    table = markdown_table(
        [
            "Run",
            "predicted before start (s)",
            "first ETA (s)",
            "time to READY (s)",
            "predicted error",
            "first ETA error",
            "phases from",
        ],
        rows,
        ["l", "r", "r", "r", "r", "r", "l"],
    )
    times = [f["command_s"] for f in figures if f.get("command_s") is not None]
    parts = [
        "Before each start, `glowplug startup --predict-only` in the same cache dir (no torch, no weight read) "
        "gave the predicted READY (process start + imports from this machine's recorded starts, then the "
        "stages); the start's own first ETA comes after its imports, with every cache probe. "
        + (f"`--predict-only` took {min(times):.2f}-{max(times):.2f} s (the whole command)." if times else ""),
        "",
        table,
    ]
    for f in figures:
        first = f["run"] in ("cold 1", "warm 1")
        if not first or not f["phases"]:
            continue
        prows: list[list[Cell]] = []
        for stage, p in f["phases"].items():
            actual = p["actual_s"]
            prows.append(
                [
                    stage,
                    fmt_num(p["predicted_s"], 3) if p["predicted_s"] is not None else Missing("-"),
                    fmt_num(actual, 3) if actual is not None else Missing("skipped or not in the report"),
                    p["kind"] or "",
                    short(p["basis"] or "", 160),
                ]
            )
        parts += [
            "",
            f"Phase by phase, {f['run']} (predicted before the start against its own time):",
            "",
            markdown_table(["Phase", "predicted (s)", "actual (s)", "from", "basis"], prows, ["l", "r", "r", "l", "l"]),
        ]
    return "\n".join(parts)


def bench_verdicts(result: StartupBenchResult) -> list[Any]:
    """Every target of this report, each on its worst run or pair (profiling/bench/verdicts.py)."""
    from .verdicts import Verdict

    out: list[Verdict] = []
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for f in eta_figures(result):
        by_kind.setdefault(f["kind"], []).append(f)
    for kind, figures in by_kind.items():
        target = figures[0]["target"]
        missing = [f for f in figures if f["error"] is None]
        if missing:
            out.append(
                Verdict(f"first ETA within {target:.0%} of READY ({kind})", f"{missing[0]['run']}: no ETA", False)
            )
            continue
        worst = max(figures, key=lambda f: abs(f["error"]))
        out.append(
            Verdict(
                f"first ETA within {target:.0%} of READY ({kind})",
                f"{worst['run']}: {100 * worst['error']:+.1f}% ({float(worst['eta_s']):.2f} s vs "
                f"{worst['actual_s']:.2f} s)",
                abs(worst["error"]) <= target,
            )
        )
    if result.bundle is not None and result.bundle.error is None:
        f = bundle_figures(result)
        out.append(
            Verdict(
                f"bundle size over the model as stored <= {BUNDLE_EXTRA_BYTES / 1e6:.0f} MB",
                f"{f['extra_bytes'] / 1e6:.1f} MB",
                f["size_pass"],
            )
        )
        if "create_pass" in f:
            out.append(
                Verdict(
                    f"`bundle create` <= median cold start + {BUNDLE_CREATE_EXTRA_S:.0f} s",
                    f"{f['create_over_cold_s']:+.2f} s",
                    f["create_pass"],
                )
            )
        if "ratio_worst" in f:
            out.append(
                Verdict(
                    f"start from the bundle / warm start <= {BUNDLE_START_TARGET:.1f}x (worst pair)",
                    f"worst pair {f['ratio_worst']:.3f}x",
                    f["ratio_pass"],
                )
            )
    overhead = tracing_overhead(result) if result.config.tracing_overhead else None
    if overhead is not None:
        resolved = overhead.ci_low is not None and overhead.ci_high is not None and overhead.resolvable
        measured = f"median {100 * overhead.relative:+.2f}%" + (
            f", 95% interval {100 * overhead.ci_low:+.2f}% to {100 * overhead.ci_high:+.2f}%"
            if overhead.ci_low is not None and overhead.ci_high is not None
            else ", too few pairs for an interval"
        )
        out.append(
            Verdict(
                f"OTLP export adds <= {TRACING_TARGET:.0%} to READY",
                measured,
                (overhead.ci_high is not None and overhead.ci_high <= TRACING_TARGET) if resolved else None,
            )
        )
    return out + poll_verdicts(result.poll)


def _ranks_text(result: StartupBenchResult) -> str:
    """Under tensor parallelism: each row's slowest rank and the spread across ranks, and the rank that held READY
    back, as the last warm start's phase table notes them (profiling/phases.py with_rank_spread), then its lanes."""
    last = next((r for r in reversed(result.runs.get("warm", [])) if r.ok), None)
    if last is None:
        return "No warm start reached READY."
    notes = last.report.get("notes") or {}
    rows = [[row, "; ".join(n for n in ns if "rank" in n)] for row, ns in notes.items() if any("rank" in n for n in ns)]
    text = markdown_table(["Phase", f"{last.label}: ranks"], rows) if rows else "The phase table names no ranks."  # type: ignore[arg-type]
    lanes = Path(result.config.out_dir) / "rank_lanes.png"
    if result.config.plots:
        text += (
            f"\n\n![each rank's stages]({lanes.name}) each rank's stages in {last.label}, from its Chrome/Perfetto "
            f"trace ({LANES_TRACE}: it loads in ui.perfetto.dev, one lane group per rank)"
        )
    return text


def _eta_text(result: StartupBenchResult) -> str:
    figures = eta_figures(result)
    if not figures:
        return "No start had an ETA."
    rows: list[list[Cell]] = []
    for f in figures:
        if f["error"] is None:
            rows.append(
                [
                    f["kind"],
                    f["run"],
                    Missing(f["basis"] or "no ETA"),
                    fmt_num(f["actual_s"], 3),
                    Missing("no ETA"),
                    f"within {f['target']:.0%}: FAIL",
                ]
            )
            continue
        ok = abs(f["error"]) <= f["target"]
        rows.append(
            [
                f["kind"],
                f["run"],
                fmt_num(float(f["eta_s"]), 3),
                fmt_num(f["actual_s"], 3),
                f"{100 * f['error']:+.1f}%",
                f"within {f['target']:.0%}: {'PASS' if ok else 'FAIL'}",
            ]
        )
    table = markdown_table(
        ["Start", "Run", "first ETA (s)", "time to READY (s)", "error", "target"], rows, ["l", "l", "r", "r", "r", "l"]
    )
    return (
        "The first ETA is taken as the stages begin (after the bundle's install for a start from a bundle): "
        f"time so far plus the predicted stages.\n\n{table}"
    )


def render_markdown(result: StartupBenchResult, argv: list[str] | None = None) -> str:
    from .machine import report_header

    cfg = result.config
    header = report_header("Start-up benchmark: cold vs warm", argv)
    if cfg.from_runs is not None:
        # The header's machine and versions are the renderer's; the starts' own are in their reports.
        first = next((r for m in (*MODES, *EXTRA_MODES) for r in result.runs.get(m, []) if r.report), None)
        ran = ", ".join(f"{k} {v}" for k, v in ((first.report.get("versions") or {}) if first else {}).items())
        header += (
            f"\n- the starts ran elsewhere (their reports, read from `{cfg.from_runs}`, say: {ran or 'nothing'}); "
            "the machine and versions above only rendered this page"
        )
    parts = [
        header,
        f"Each start is `glowplug startup {' '.join(cfg.startup_args())}` in a fresh process. {cfg.runs} cold "
        "start(s), each with an empty `GLOWPLUG_CACHE_DIR`; then as many warm starts reusing the cache the last cold "
        f"start filled. Percentiles: {PERCENTILE_METHOD}.",
        "",
        "## Time to READY",
        "",
    ]
    ready: list[list[Cell]] = []
    for mode in modes(result):
        stat = phase_stat(result.runs[mode], READY_ROW)
        cells: list[Cell] = (
            [fmt_num(getattr(stat.summary, k), 3) for k in STATS] if stat.summary else [Missing(stat.why)] * len(STATS)
        )
        ready.append([mode, *cells, sum(r.ok for r in result.runs[mode]), len(result.runs[mode])])
    parts += [markdown_table(["Start", "median (s)", "min (s)", "max (s)", "OK", "Runs"], ready), ""]
    table, never = _phase_table(result)
    parts += ["## Phases", "", AGGREGATES_TEXT, "", table, ""]
    if never:
        parts += ["Phases that ran in no start: " + ", ".join(never) + ".", ""]
    parts += ["## Beside seed 004 (vLLM start-up)", "", _seed_text(result), ""]
    if result.config.tensor_parallel_size > 1:
        parts += ["## Per rank", "", _ranks_text(result), ""]
    parts += ["## Start from a bundle", "", _bundle_text(result), ""]
    parts += ["## First ETA against the time to READY", "", _eta_text(result), ""]
    if cfg.predict or prediction_figures(result):
        parts += ["## Predicted against actual", "", _prediction_text(result), ""]
    if cfg.poll_serve or result.poll is not None:
        parts += ["## A serve start polled every 0.2 s", "", poll_text(result.poll), ""]
    parts += ["## Cache hits", ""]
    counts = {m: cache_hit_counts(result.runs[m]) for m in modes(result)}
    rows_with_cache = sorted(set().union(*counts.values()))
    hit_rows: list[list[Cell]] = []
    for row in rows_with_cache:
        hit_rows.append(
            [
                row,
                *(
                    f"{h} of {n}" if (h, n) != (0, 0) else Missing("no run")
                    for h, n in (counts[m].get(row, (0, 0)) for m in modes(result))
                ),
            ]
        )
    hits_table = (
        markdown_table(["Phase", *(f"{m}: hits" for m in modes(result))], hit_rows) if hit_rows else "No phase caches."
    )
    parts += [hits_table, ""]
    parts += ["## Tracing overhead", "", _tracing_text(result), ""]
    parts += ["## Runs", "", _runs_table(result), ""]
    from .verdicts import verdicts_markdown

    parts += [
        "## Verdicts",
        "",
        "Every target of this report on its worst run or pair.",
        "",
        verdicts_markdown(bench_verdicts(result)),
        "",
    ]
    failed = [r for m in (*MODES, *EXTRA_MODES, *TRACING_MODES) for r in result.runs.get(m, []) if not r.ok]
    if failed:
        parts += ["Failures in full:", ""] + [f"- {r.label}: {r.error}" for r in failed] + [""]
    return "\n".join(parts)


def result_dict(result: StartupBenchResult) -> dict[str, Any]:
    summary: dict[str, dict[str, Any]] = {}
    for mode in modes(result):
        summary[mode] = {}
        for row in row_names(result):
            stat = phase_stat(result.runs[mode], row)
            summary[mode][row] = {**(stat.summary.as_dict() if stat.summary else {}), "note": stat.note}
    overhead = tracing_overhead(result)
    return {
        "tracing_overhead": None if overhead is None else dict(overhead.__dict__),
        "config": result.config.model_dump(mode="json"),
        "percentile_method": PERCENTILE_METHOD,
        "summary": summary,
        "cache_hits": {
            m: {k: {"hits": h, "runs": n} for k, (h, n) in cache_hit_counts(result.runs[m]).items()}
            for m in modes(result)
        },
        "bundle": None if result.bundle is None else {**result.bundle.__dict__, **bundle_figures(result)},
        "eta": eta_figures(result),
        "predictions": prediction_figures(result),
        "verdicts": [vars(v) for v in bench_verdicts(result)],
        "seed_004": {m: seed_maps(result.runs[m]) for m in modes(result)},
        "compare_to": _compare_summary(result.config.compare_to),
        "runs": runs_list(result.runs),
        "poll": None if result.poll is None else result.poll.to_json(),
    }


def _compare_summary(before_json: Path | None) -> dict[str, Any] | None:
    """The earlier report --compare-to drew beside this one: its path and its summary (the medians the plot used),
    folded in here so the before/after plot's data lives in this report's one JSON."""
    import json

    if before_json is None:
        return None
    return {"source": str(before_json), "summary": json.loads(before_json.read_text())["summary"]}


def seed_maps(runs: list[StartupRun]) -> list[dict[str, float | None]]:
    """Each successful start's phases as seed 004's rows (profiling/bench/vllm_startup_rows.py)."""
    from .vllm_startup_rows import default_leaves, map_phases

    return [
        map_phases(
            r.phases, [n for n, k in r.report.get("kinds", {}).items() if k == "leaf"] or default_leaves(r.phases)
        )
        for r in runs
        if r.ok
    ]


def leaf_rows(runs: list[StartupRun]) -> list[str]:
    """Leaf phases in report order (pipeline order); with the overlap subtracted they make the time to READY."""
    names: list[str] = []
    for run in runs:
        kinds = run.report.get("kinds", {})
        names += [n for n, k in kinds.items() if k == "leaf" and n not in names]
    return names


def write_reports(result: StartupBenchResult, argv: list[str] | None = None) -> list[Path]:
    out = prepare_out_dir(result.config.out_dir)
    md, js = out / "startup.md", out / "startup.json"
    md.write_text(render_markdown(result, argv))
    write_json(js, result_dict(result))
    from .verdicts import write_verdicts

    written = [md, js, write_verdicts(md, bench_verdicts(result))]
    if result.config.save_baseline is not None:
        written.append(save_baseline(result, result.config.save_baseline, argv))
    ok = [r for m in modes(result) for r in result.runs[m] if r.ok]  # the plot: cold, warm and bundle
    if result.config.plots and ok:
        from .plots import plot_phase_stack

        stacks = {row: [r.phases.get(row) for r in ok] for row in leaf_rows(ok)}
        groups = [m for m in modes(result) for r in result.runs[m] if r.ok]
        counts = ", ".join(f"{m} n={groups.count(m)}" for m in dict.fromkeys(groups))
        title = (
            f"glowplug start-up, {Path(str(result.config.model)).name}: own time per phase (s), pipeline order, "
            f"one bar per start ({counts}); each kind of start in its own panel with its own scale"
        )
        ready = [r.phases.get(READY_ROW) or 0.0 for r in ok]
        written.append(
            plot_phase_stack(
                [r.label for r in ok],
                stacks,
                out / "startup_phases.png",
                title=title,
                xlabel="start",
                totals=ready,
                totals_label="time to READY",
                groups=groups,
            )
        )
    trace = out / LANES_TRACE
    if result.config.plots and result.config.tensor_parallel_size > 1 and trace.is_file():
        import json

        from .plots import plot_trace_lanes

        written.append(
            plot_trace_lanes(
                json.loads(trace.read_text()),
                out / "rank_lanes.png",
                title=f"the last warm start at --tensor-parallel-size "
                f"{result.config.tensor_parallel_size}: each rank's stages ({LANES_TRACE})",
            )
        )
    if result.config.plots and ok and result.config.compare_to is not None:
        written.append(_before_after_plot(result, result.config.compare_to, out / "startup_before_after.png"))
    return written


def save_baseline(result: StartupBenchResult, path: Path, argv: list[str] | None = None) -> Path:
    """The cold and warm starts as the regression gate's baseline (profiling/baseline.py)."""
    from glowplug.profiling.baseline import write_baseline

    from .machine import command_line, git_state, machine_summary

    by_kind = {m: [r.report for r in result.runs[m] if r.ok] for m in MODES}
    state = git_state()
    return write_baseline(
        path, by_kind, command=command_line(argv), machine=machine_summary(), commit=state.commit or "unknown"
    )


def _before_after_plot(result: StartupBenchResult, before_json: Path, path: Path) -> Path:
    """Median leaves per mode, the earlier report's (`compare_to`) beside this one's: what changed, phase by phase."""
    import json

    from .plots import plot_phase_stack

    before = json.loads(before_json.read_text())["summary"]
    after = result_dict(result)["summary"]
    leaves = leaf_rows([r for m in modes(result) for r in result.runs[m] if r.ok])
    columns: list[tuple[str, dict[str, Any]]] = [(f"before {m}", before[m]) for m in ("cold", "warm") if m in before]
    columns += [(f"now {m}", after[m]) for m in modes(result)]
    # cold beside cold, warm beside warm: one panel per kind of start, each on its own scale
    columns.sort(
        key=lambda c: list(modes(result)).index(c[0].split(" ", 1)[1]) if c[0].split(" ", 1)[1] in modes(result) else 99
    )
    stacks = {row: [col.get(row, {}).get("p50") for _, col in columns] for row in leaves}
    totals = [col.get(READY_ROW, {}).get("p50") or 0.0 for _, col in columns]
    title = (
        f"glowplug start-up, {Path(str(result.config.model)).name}: median own time per phase (s), "
        f"before ({before_json}) and now"
    )
    n = {m: sum(r.ok for r in result.runs[m]) for m in modes(result)}
    title += "; now: " + ", ".join(f"{m} n={k}" for m, k in n.items())
    return plot_phase_stack(
        [name for name, _ in columns],
        stacks,
        path,
        title=title,
        xlabel="start",
        totals=totals,
        totals_label="time to READY (median)",
        groups=[name.split(" ", 1)[1] for name, _ in columns],
    )


def runs_from_folder(cfg: StartupBenchConfig, source: Path) -> StartupBenchResult:
    """The runs an earlier bench left (see --from-runs): its startup.json (the file, or the folder holding it), or
    an older version's per-start files in a folder, each a start that reached READY when its report says so."""
    import json

    found = runs_source(source)
    if found is None:
        raise ValueError(f"--from-runs {source}: no startup.json, cold-N.json or warm-N.json there")
    if found.is_file():
        return _runs_from_json(cfg, json.loads(found.read_text()), found)
    runs: dict[Mode, list[StartupRun]] = {m: [] for m in (*MODES, *EXTRA_MODES, *TRACING_MODES)}
    kinds: tuple[tuple[Mode, str], ...] = (
        ("cold", "cold-*.json"),
        ("warm", "warm-*.json"),
        ("bundle", "bundle-[0-9]*.json"),
        ("bundle_isa_capped", "bundle-isa-capped.json"),
        ("cold_after_warm", "cold-after-warm.json"),
        ("otlp_off", "otlp_off-*.json"),
        ("otlp_on", "otlp_on-*.json"),
    )
    for mode, pattern in kinds:
        for path in sorted(found.glob(pattern), key=lambda p: (len(p.name), p.name)):
            if mode == "cold" and path.name == "cold-after-warm.json":
                continue
            report = json.loads(path.read_text())
            ready = (report.get("phases") or {}).get(READY_ROW)
            label = path.stem.replace("-", " ")
            runs[mode].append(
                StartupRun(
                    label,
                    0 if ready is not None else 1,
                    float(ready or 0.0),
                    report,
                    None if ready is not None else "the report has no READY time",
                )
            )
    if not runs["cold"] and not runs["warm"]:
        raise ValueError(f"--from-runs {source}: no cold-N.json or warm-N.json there")
    return StartupBenchResult(cfg, runs, None)


def _runs_from_json(cfg: StartupBenchConfig, data: dict[str, Any], path: Path) -> StartupBenchResult:
    """A startup.json's runs (each with its whole start-up report) and its bundle, as the run that wrote it had them."""
    runs: dict[Mode, list[StartupRun]] = {m: [] for m in (*MODES, *EXTRA_MODES, *TRACING_MODES)}
    for entry in data.get("runs", []):
        if entry.get("mode") not in runs:
            continue
        report = entry.get("report")
        if report is None:  # a startup.json from before the reports were kept: its phases are all there is
            report = {"phases": entry.get("phases") or {}, "reasons": entry.get("reasons") or {}}
        runs[entry["mode"]].append(
            StartupRun(
                entry["label"],
                int(entry["returncode"]),
                float(entry["wall_s"]),
                report,
                entry.get("error"),
                entry.get("prediction"),
            )
        )
    if not runs["cold"] and not runs["warm"]:
        raise ValueError(f"--from-runs {path}: it holds no cold or warm start")
    b = data.get("bundle")
    made = None if not b else BundleMade(float(b["wall_s"]), int(b["size"]), int(b["model_bytes"]), b.get("error"))
    poll = ServePoll.from_json(data["poll"]) if data.get("poll") else None
    return StartupBenchResult(cfg, runs, made, poll)


def main(cfg: StartupBenchConfig, argv: list[str] | None = None) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    if cfg.from_runs is not None:
        result = runs_from_folder(cfg, cfg.from_runs)
    else:
        result = run_startup_bench(cfg, progress=lambda msg: err.print(msg, markup=False))
    paths = write_reports(result, argv)
    print(render_markdown(result, argv))  # plain Markdown: a terminal-fitted table would truncate numbers
    err.print("wrote " + ", ".join(map(str, paths)), markup=False)
    every = (*MODES, *EXTRA_MODES, *TRACING_MODES)
    return 0 if all(r.ok for m in every for r in result.runs.get(m, [])) else 1


def register(subparsers: Any, add_model_flags: AddModelFlags) -> Any:
    return add_command(
        subparsers,
        "startup",
        help_text="N cold and N warm start-ups in fresh processes: per-phase statistics and time to READY.",
        description=__doc__,
        config_cls=StartupBenchConfig,
        add_model_flags=add_model_flags,
        runner=main,
    )
