"""The `glowplug` command: the front door from flags to the layers below.

Heavy imports (torch, transformers) happen inside the commands, after the entry timestamp is taken, so the
start-up table can show the interpreter start and the imports as rows of their own; and the settings are checked
against the model before them (engine/config_check.py preflight), so a setting the model cannot take fails within
a second. The grammar every command shares (model argument, list flags, errors) is base/flags.py's.

Exit status: 0 done; 1 the start-up (or the command's work) failed; 2 a setting or argument is wrong (the message
names it); 3 `startup --baseline`: a phase regressed beyond noise (the message names it); 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base.flags import (
    CommandParser,
    FlagError,
    add_model_argument,
    add_model_flags,
    explain,
    load_config_file,
    resolve_model_argument,
)

if TYPE_CHECKING:
    from glowplug.engine.config import EngineConfig
    from glowplug.profiling.progress import StartupProgress
    from glowplug.profiling.tracing import Tracing

Command = Callable[[argparse.Namespace], int]

DESCRIPTION = """\
Run and serve LLMs on the CPU (and CUDA GPUs), with a start-up you can see.

  glowplug generate "The capital of France is"     complete a prompt (the embedded SmolLM2-135M by default)
  glowplug serve                                   OpenAI-compatible API on http://127.0.0.1:8000/v1
  glowplug startup                                 start the engine, print where the start-up time went
  glowplug cache ls                                what the caches hold and how big they are

MODEL is 'smollm2' (embedded), a Hugging Face folder or a .gguf file: the first argument, or --model.
Run `glowplug COMMAND --help` for a command's options."""

# `generate`'s own default; the sampling defaults come from the model (engine/generation_config.py).
GENERATE_MAX_TOKENS = 64
SAMPLING_DEFAULT_TEXT: dict[str, str] = {
    "temperature": "the model's generation config, else 0 = greedy",
    "top_p": "the model's generation config, else 1.0",
    "top_k": "the model's generation config, else -1",
    "min_p": "the model's generation config, else 0.0",
    "repetition_penalty": "the model's generation config, else 1.0",
    "max_tokens": str(GENERATE_MAX_TOKENS),
}
SETTING_ERROR = 2
STARTUP_FAILED = 1
REGRESSED = 3


def version_text() -> str:
    """`glowplug 0.1.0 (torch 2.13.0+cpu, python 3.11.9)`, from package metadata: no torch import."""

    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"glowplug {version('glowplug')} (torch {version('torch')}, python {sys.version.split()[0]})"


# The top-level commands: a command line naming one builds only its parser (build_parser).
COMMANDS = ("generate", "startup", "serve", "bench", "tune", "bundle", "cache", "kernels", "models")


class _VersionAction(argparse.Action):
    """`--version`: the text is read from package metadata when asked for, not each time the parser is built
    (importlib.metadata costs every command tens of milliseconds)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.help = "show program's version number and exit"

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
        print(version_text())
        parser.exit()


def _engine_parent() -> argparse.ArgumentParser:
    from glowplug.engine.config import EngineConfig

    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine (one flag per EngineConfig field)")
    g.add_argument("--config", type=Path, help="A .json or .toml file of engine flags (flags given here win).")
    add_model_flags(g, EngineConfig, exclude={"model"})
    return p


def _sampling_parent() -> argparse.ArgumentParser:
    from glowplug.engine.sampling_params import SamplingParams

    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sampling (one flag per SamplingParams field; unset ones follow the model)")
    # --seed belongs to the engine: it seeds every request that does not bring its own seed.
    add_model_flags(g, SamplingParams, exclude={"seed", "grammar", "logit_bias"}, defaults=SAMPLING_DEFAULT_TEXT)
    return p


def _output_parent() -> argparse.ArgumentParser:
    """What a command that starts an engine in this process prints while it starts."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("output")
    g.add_argument("--quiet", action="store_true", help="No start-up progress (stderr); errors still show.")
    g.add_argument(
        "--verbose",
        action="store_true",
        help="On a failure, also the log record and the traceback (by default one line with the cause and the fix).",
    )
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from glowplug.engine.config import CacheConfig, EngineConfig, QuantConfig, SchedulerConfig

    fields: dict[str, Any] = {}
    bundle = vars(args).get("bundle")
    if bundle:
        # The bundle's flags are the defaults; a config file and the flags given here win, as over the defaults.
        from glowplug.base.artifacts.bundle import read_header

        header = read_header(Path(bundle).expanduser())
        fields.update(header.config)
        if not getattr(args, "model_given", True) and header.model.get("spec"):
            args.model = header.model["spec"]
    if getattr(args, "config", None):
        fields.update(load_config_file(args.config))
    names = set(EngineConfig.model_fields) | set(SchedulerConfig.model_fields)
    names |= set(CacheConfig.model_fields) | set(QuantConfig.model_fields)
    fields.update({k: v for k, v in vars(args).items() if k in names})
    if getattr(args, "model", None):
        fields["model"] = args.model
    unknown = set(fields) - names - {"scheduler", "cache", "quant"}
    if unknown:
        raise FlagError(f"unknown setting(s) {', '.join(sorted(unknown))}; see `glowplug startup --help`")
    config = EngineConfig.from_flat(**fields)
    world = launched_world_size()
    if world > 1 and config.tensor_parallel_size == 1:
        # Under torchrun the ranks it started are the tensor-parallel group (a differing flag is refused later).
        config = config.model_copy(update={"tensor_parallel_size": world})
    return config


def launched_world_size() -> int:
    """WORLD_SIZE when a launcher (torchrun) gave this process a RANK, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def torchrun_worker(config: EngineConfig) -> int | None:
    """Under torchrun, every rank but 0 runs the engine only (rank 0 serves, generates or reports): its exit
    status, or None on rank 0 and outside torchrun."""
    if config.tensor_parallel_size == 1 or os.environ.get("RANK", "0") == "0":
        return None
    from glowplug.engine.tp_worker import run_worker

    return run_worker(config)


def sampling_params(args: argparse.Namespace, defaults: Mapping[str, Any]) -> Any:
    from glowplug.engine.sampling_params import SamplingParams

    given = {k: v for k, v in vars(args).items() if k in SamplingParams.model_fields and k not in ("seed", "grammar")}
    return SamplingParams(**{**defaults, **given})


def _check_settings(config: EngineConfig) -> None:
    """The settings against the model and the torch build, before any heavy import (config_check.preflight).
    A model it cannot read here is left to the start-up, which reports it with its stage and fix."""
    from glowplug.engine.config_check import check_device, preflight
    from glowplug.engine.models.arch import ModelError

    try:
        preflight(config)
    except ModelError:
        check_device(config)


def _stage_failure_record(event: Mapping[str, Any]) -> bool:
    """The failed stage's own error record: on a terminal the one FAILED line says the same (--verbose keeps it)."""
    from glowplug.profiling.names import STARTUP_SPAN

    return event.get("level") == "error" and str(event.get("event", "")).startswith(STARTUP_SPAN + ".")


def _configure_logging(args: argparse.Namespace, level: str) -> None:
    from glowplug.profiling.logs import configure_logging

    on_tty = sys.stderr.isatty()
    configure_logging(level=level, drop=_stage_failure_record if on_tty and not args.verbose else None)


def _begin_progress(args: argparse.Namespace, config: EngineConfig) -> StartupProgress | None:
    """The first progress line, before the heavy imports (None with --quiet)."""
    if args.quiet:
        return None
    from glowplug.profiling.progress import StartupProgress

    progress = StartupProgress()
    progress.begin(config.model)
    return progress


def _imports_done(
    args: argparse.Namespace, config: EngineConfig, progress: StartupProgress | None, tracing: Tracing
) -> None:
    """Say how long the imports took and what to expect, and follow the stages from here on."""
    marks = args.marks
    marks.mark_imports_done()
    from glowplug.engine.startup import plan_start

    if config.bundle is not None:
        # The plan needs the bundle installed (its hits); build_engine makes it then and calls `_plan_known`.
        args.start_plan = None
        if progress is not None:
            waiting = "installing the bundle first; the estimate follows"
            progress.imports_done((marks.imports_done_ns - marks.main_entry_ns) / 1e9, None, waiting)
            tracing.provider.add_span_processor(progress)
        return
    # Made with or without progress: the start records it (its cache pattern, the first ETA) in its report.
    args.start_plan = plan_start(config)
    if progress is None:
        return
    progress.imports_done((marks.imports_done_ns - marks.main_entry_ns) / 1e9, args.start_plan.estimate)
    tracing.provider.add_span_processor(progress)


def _plan_known(progress: StartupProgress | None) -> Callable[[Any], None] | None:
    """The progress line's ETA for a plan made after the imports (a start from a bundle)."""
    if progress is None:
        return None

    def show(plan: Any) -> None:
        progress.plan_known(plan.estimate, plan.basis)

    return show


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    model, prompts = generate_words(args)
    args.model = model
    config = engine_config(args)
    _check_settings(config)
    worker = torchrun_worker(config)
    if worker is not None:
        return worker
    from glowplug.engine.generation_config import sampling_defaults

    defaults = sampling_defaults(config.model)
    params = sampling_params(args, {"max_tokens": GENERATE_MAX_TOKENS, **defaults.values})
    # Start-up stage logs would interleave with the generated text; warnings and errors still show.
    _configure_logging(args, "warning")
    progress = _begin_progress(args, config)
    if progress is not None:
        progress.note(f"sampling: {defaults.describe()}")
    from glowplug.engine.llm import LLM
    from glowplug.profiling.tracing import setup_tracing

    tracing = setup_tracing()
    try:
        _imports_done(args, config, progress, tracing)
        llm = LLM(config=config, tracing=tracing)
        if progress is not None:  # from the process's creation, like the phase table of `glowplug startup`
            progress.close(ready_s=(args.marks.clock.now_ns() - args.marks.process_start_ns) / 1e9)
    finally:
        if progress is not None:
            progress.close()
    out = Console(soft_wrap=True, highlight=False)
    if len(prompts) == 1 and params.n == 1:
        out.print(prompts[0] if not args.chat else f"[dim]{prompts[0]}[/dim]\n", end="", style="bold")
        last = None
        for update in llm.stream(prompts, params, chat=args.chat):
            out.print(update.outputs[0].delta, end="", markup=False)
            last = update
        reason = last.outputs[0].finish_reason if last else None
        out.print(f"\n[dim](finish_reason={reason})[/dim]")
        return 0
    for res in llm.generate(prompts, params, chat=args.chat):
        for c in res.outputs:
            out.rule(f"prompt: {res.prompt!r}  completion {c.index}  finish_reason={c.finish_reason}")
            out.print(c.text, markup=False)
    return 0


def looks_like_model(word: str) -> bool:
    """Whether a positional word names a model: the embedded default's names, a .gguf file, or a folder with a
    config.json. A prompt is none of these (a prompt that is also an existing path needs --model before it)."""
    from glowplug.engine.models.store import DEFAULT_ALIASES

    if word in DEFAULT_ALIASES:
        return True
    path = Path(word).expanduser()
    try:
        return (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file())
    except OSError:  # a prompt too long to be a file name
        return False


def generate_words(args: argparse.Namespace) -> tuple[str, list[str]]:
    """(model, prompts) from `generate [MODEL] PROMPT...`: the first word is the model when --model is not given,
    another word follows, and it names a model (looks_like_model)."""
    words: list[str] = list(args.words)
    option = getattr(args, "model_option", None)
    args.model_given = True
    if option is None and len(words) >= 2 and looks_like_model(words[0]):
        return words[0], words[1:]
    args.model_given = option is not None
    return option or args.model_default, words


def _predict_only(args: argparse.Namespace, config: EngineConfig) -> int:
    """`startup --predict-only`: the predicted phases of a start of `config`, without starting it (no torch, no
    weight read: engine/start_profile.py predict_before_start)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from glowplug.base.artifacts.cachedir import cache_dir_from_env
    from glowplug.engine.start_estimate import pattern_text
    from glowplug.engine.start_profile import predict_before_start

    plan = predict_before_start(config, cache_dir_from_env())
    estimate = plan.estimate
    if estimate is None:
        raise ValueError(f"no prediction for {config.model}: {'; '.join(plan.notes) or plan.basis}")
    before = estimate.before_s
    stages = estimate.total_s
    data = {
        "kind": "prediction",
        "model": config.model,
        "pattern": plan.pattern,
        "basis": estimate.basis,
        "before_s": before,
        "stages_s": stages,
        "ready_s": None if before is None else before + stages,
        "inputs": plan.inputs.to_json() if plan.inputs is not None else None,
        "notes": list(plan.notes),
        "phases": {
            s: {"seconds": v, **(estimate.sources[s].to_json() if s in estimate.sources else {})}
            for s, v in estimate.seconds.items()
        },
    }
    if args.report_out:
        if Path(args.report_out).suffix != ".json":
            raise ValueError(f"--report-out {args.report_out}: a prediction is written as .json")
        Path(args.report_out).write_text(json.dumps(data, indent=1) + "\n")
    table = Table(
        title=f"predicted start-up of {config.model} (not started)",
        caption=f"cache: {pattern_text(plan.pattern)}; {estimate.basis}",
        show_edge=False,
        pad_edge=False,
    )
    table.add_column("phase", no_wrap=True)
    table.add_column("seconds", justify="right", no_wrap=True)
    table.add_column("from", no_wrap=True)
    table.add_column("basis")
    if before is not None:
        table.add_row(
            "process start + imports", f"{before:.3f}", "recorded", "median of this machine's recorded starts"
        )
    for stage, value in estimate.seconds.items():
        src = estimate.sources.get(stage)
        table.add_row(stage, f"{value:.3f}", src.kind if src else "", src.basis if src else "")
    table.add_row(
        "stages (wall)",
        f"{stages:.3f}",
        "",
        "critical path through the pipeline's waits"
        if estimate.deps
        else "sum of the stages x wall/sum of the recorded start",
        end_section=True,
    )
    table.add_row(
        "READY",
        "--" if before is None else f"{before + stages:.3f}",
        "",
        "from process creation"
        if before is not None
        else "no recorded start: process start + imports unknown, add them",
        style="bold",
    )
    console = Console(width=max(Console().width, 160) if args.wide else None)
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {note}", style="dim")
    return 0


def _gate(args: argparse.Namespace, table: Any) -> int:
    """`startup --baseline`: this start's phases against the baseline (profiling/baseline.py); 0, or REGRESSED."""
    from rich.console import Console
    from rich.table import Table

    from glowplug.profiling.baseline import check, parse_fraction, read_baseline
    from glowplug.profiling.phases import to_dict

    result = check(to_dict(table), read_baseline(Path(args.baseline)), parse_fraction(args.max_regression))
    out = Table(title=f"against the {result.kind} baseline {args.baseline}", show_edge=False, pad_edge=False)
    for name, justify in (
        ("phase", "left"),
        ("baseline median", "right"),
        ("spread", "right"),
        ("this start", "right"),
        ("limit", "right"),
        ("verdict", "left"),
    ):
        out.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for c in result.checks:
        out.add_row(
            c.phase,
            f"{c.median:.3f}",
            f"{c.spread:.3f}",
            f"{c.seconds:.3f}",
            f"{c.limit:.3f}",
            "REGRESSED" if c.regressed else "ok",
            style="bold red" if c.regressed else "",
        )
    console = Console()
    console.print(out)
    if result.missing:
        console.print(f"not run by this start: {', '.join(result.missing)}", style="dim")
    _say(result.summary())
    return 0 if result.passed else REGRESSED


def cmd_startup(args: argparse.Namespace) -> int:
    """Run the start-up pipeline to READY, print the phase table, write the requested reports, exit."""
    from rich.console import Console

    config = engine_config(args)
    if args.predict_only:
        return _predict_only(args, config)
    if args.baseline:
        from glowplug.profiling.baseline import parse_fraction, read_baseline

        read_baseline(Path(args.baseline))  # a wrong file fails now, not after the start
        parse_fraction(args.max_regression)
    _check_settings(config)
    worker = torchrun_worker(config)
    if worker is not None:
        return worker
    _configure_logging(args, args.log_level)
    progress = _begin_progress(args, config)
    from glowplug.profiling.imports import import_startup_modules

    import_startup_modules(args.marks)
    from glowplug.engine.startup import StartupFailed, build_engine
    from glowplug.profiling import export, phases
    from glowplug.profiling.names import STARTUP_SPAN, Row
    from glowplug.profiling.tracing import setup_tracing

    tracing = setup_tracing()
    failed: StartupFailed | None = None
    try:
        _imports_done(args, config, progress, tracing)
        table = build_engine(
            config, tracing=tracing, marks=args.marks, plan=args.start_plan, on_plan=_plan_known(progress)
        ).phase_table
        if progress is not None:
            progress.close(ready_s=table.actual_total_time)
        # For whoever times this process from outside (tests, benchmarks): READY has been reached.
        print("glowplug: READY", file=sys.stderr, flush=True)
    except StartupFailed as exc:
        failed = exc
        # The failed stage's span is finished too: the table and traces show how far the start got.
        table = phases.build_phase_table([s for s in tracing.finished_spans() if s.name.startswith(STARTUP_SPAN)])
    finally:
        if progress is not None:
            progress.close()  # the live display gives the terminal back before anything else is printed
    if args.import_times and failed is None:
        from glowplug.profiling.imports import measure_import_costs, top_note
        from glowplug.profiling.names import Attr

        costs = measure_import_costs()
        table = phases.with_row_note(
            table, Row.IMPORTS, top_note(costs), {Attr.IMPORT_TOP: [f"{c.package} {c.self_s:.3f}" for c in costs[:5]]}
        )
    spans = list(tracing.finished_spans())
    if args.report_out:
        phases.write_report(table, args.report_out)
    if args.trace_out:
        export.write_otlp_json(spans, args.trace_out)
    if args.chrome_trace:
        export.write_chrome_trace(spans, args.chrome_trace)
    tracing.shutdown()  # flushes any OTLP exporter
    if failed is not None:
        raise failed  # main() says it in one line
    rendered = phases.to_rich(table, wide=args.wide)
    console = Console()
    if args.wide:  # as wide as the notes are, whatever the terminal: --wide is for a file or a wide pager
        from rich.measure import Measurement

        width = Measurement.get(console, console.options.update(width=100_000), rendered).maximum
        console = Console(width=max(width, console.width))
    console.print(rendered)
    if args.baseline:
        return _gate(args, table)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from glowplug.lifecycle.config import serve_config_from_args

    config = engine_config(args)
    serve_cfg = serve_config_from_args(args)
    _check_settings(config)  # before the server's imports: a wrong setting fails within a second, not at start-up
    worker = torchrun_worker(config)
    if worker is not None:
        return worker
    display = None
    if not args.quiet and sys.stderr.isatty() and serve_cfg.log_format != "json":
        # On a terminal: one line per stage, as `glowplug startup` prints them (the stages run in the engine core
        # process; their spans come here). The stages' key=value log records then need --verbose.
        from glowplug.profiling.progress import StartupProgress

        display = StartupProgress()
        display.begin(config.model)
    from glowplug.base.process import exit_process
    from glowplug.lifecycle.server import serve

    exit_process(serve(config, serve_cfg, marks=args.marks, display=display, verbose=args.verbose))


def _bench_config(model_cls: Any, args: argparse.Namespace) -> Any:
    return model_cls(**{k: v for k, v in vars(args).items() if k in model_cls.model_fields})


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from glowplug.profiling.bench.decode import DecodeBenchConfig, main

    return main(_bench_config(DecodeBenchConfig, args), args.argv)


def _report_command(config_cls: Any, run: Callable[[Any, list[str]], str]) -> Command:
    """A bench command: validate flags into `config_cls`, run, print the Markdown, write it to --out."""

    def command(args: argparse.Namespace) -> int:
        from rich.console import Console
        from rich.markdown import Markdown

        cfg = _bench_config(config_cls, args)
        text = run(cfg, args.argv)
        Console().print(Markdown(text))
        if cfg.out is not None:
            Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
            Path(cfg.out).write_text(text)
        return 0

    return command


def cmd_models_prepare(args: argparse.Namespace) -> int:
    from glowplug.engine.models.store import resolve_model

    path = resolve_model(args.model)
    print(path)
    return 0


def _writable_file(suffixes: tuple[str, ...]) -> Callable[[str], Path]:
    def check(value: str) -> Path:
        path = Path(value)
        if path.suffix not in suffixes:
            raise argparse.ArgumentTypeError(f"{value}: use a file ending in {' or '.join(suffixes)}")
        if not path.parent.exists():
            raise argparse.ArgumentTypeError(f"{value}: folder {path.parent} does not exist; create it first")
        return path

    return check


def _add_report_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reports")
    g.add_argument("--report-out", type=_writable_file((".md", ".csv", ".json")), help="Phase table (.md/.csv/.json).")
    g.add_argument("--trace-out", type=_writable_file((".json",)), help="Spans as OTLP JSON.")
    g.add_argument("--chrome-trace", type=_writable_file((".json",)), help="Chrome/Perfetto trace-event JSON.")
    g.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="Log records at this level and above go to stderr (default: warning).",
    )
    g.add_argument(
        "--wide",
        action="store_true",
        help="The phase table with every note on its row (by default notes wrap under the row name "
        "to fit the terminal).",
    )


def _add_bench_commands(bench: argparse.ArgumentParser, tune_parser: argparse.ArgumentParser) -> None:
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    from glowplug.profiling.bench.decode import DecodeBenchConfig

    dec = bsub.add_parser(
        "decode", help="Decode tokens/s per compile mode, dtype, quantization and batch size, vs transformers."
    )
    add_model_argument(dec)
    add_model_flags(dec, DecodeBenchConfig, exclude={"model"})
    dec.set_defaults(func=cmd_bench_decode)

    from glowplug.profiling.bench.accuracy import AccuracyConfig
    from glowplug.profiling.bench.cache_verify import CacheVerifyConfig, run_cache_verify_bench
    from glowplug.profiling.bench.kernel_bench import KernelBenchConfig, run_accuracy_report, run_kernel_bench

    for name, cls, run, text in (
        ("kernels", KernelBenchConfig, run_kernel_bench, "Every quantized linear path per M on the model's shapes."),
        ("accuracy", AccuracyConfig, run_accuracy_report, "Perplexity, KL and top-1 agreement of each scheme vs bf16."),
        (
            "cache-verify",
            CacheVerifyConfig,
            run_cache_verify_bench,
            "Cost of verifying a warm cache hit, quick vs full.",
        ),
    ):
        p = bsub.add_parser(name, help=text)
        add_model_argument(p)
        add_model_flags(p, cls, exclude={"model"})
        p.set_defaults(func=_report_command(cls, run))

    from glowplug.profiling.bench import all as bench_all
    from glowplug.profiling.bench import latency, screenshots, startup_bench, startup_sweep, throughput, tune
    from glowplug.profiling.bench import serve as serve_bench

    for module in (latency, throughput, startup_bench, serve_bench, bench_all, screenshots, startup_sweep):
        module.register(bsub, add_model_flags)
    tsub = tune_parser.add_subparsers(dest="tune_command", required=True, metavar="TUNE")
    tune.register(tsub, add_model_flags)


def build_parser(command: str | None = None) -> CommandParser:
    """The CLI. `command` (the first word of the command line), when it names a command, builds that command
    alone: the others' flags import their configs (every benchmark's, the server's, the sampling schema), a visible
    share of `glowplug startup`'s imports row and most of `startup --predict-only`'s second. None, or a word that
    names no command, builds everything (help, docs, tests, and the error that lists the commands)."""
    parser = CommandParser(
        prog="glowplug", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    only = command if command in COMMANDS else None

    def wanted(name: str) -> bool:
        return only is None or only == name

    engine = _engine_parent()
    output = _output_parent()
    if wanted("generate"):
        _add_generate(sub, engine, output)
    if wanted("startup"):
        _add_startup(sub, engine, output)
    if wanted("serve"):
        from glowplug.lifecycle.config import add_serve_flags

        srv = sub.add_parser(
            "serve",
            parents=[engine, output],
            help="OpenAI-compatible HTTP server (http://127.0.0.1:8000/v1 by default).",
        )
        add_model_argument(srv)
        add_serve_flags(srv.add_argument_group("serving (one flag per ServeConfig field)"))
        srv.set_defaults(func=cmd_serve)
    if wanted("bench") or wanted("tune"):
        bench = sub.add_parser(
            "bench", help="Benchmarks; reports go where --out/--out-dir says (default: ./<command>/)."
        )
        tune = sub.add_parser("tune", help="Tune start-up settings (max-model-len sweeps).")
        _add_bench_commands(bench, tune)
    if wanted("bundle"):
        from glowplug import bundle_cli

        bundle_cli.register(sub, engine, engine_config, output)
    if wanted("cache"):
        from glowplug import cache_cli

        cache_cli.register(sub)
    if wanted("kernels"):
        from glowplug import kernels_cli

        kernels_cli.register(sub)
    if wanted("models"):
        models = sub.add_parser("models", help="Manage model files.")
        msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
        prep = msub.add_parser("prepare", help="Convert a GGUF model (the embedded default) into the cache now.")
        add_model_argument(prep)
        prep.set_defaults(func=cmd_models_prepare)
        from glowplug import model_fetch

        model_fetch.register(msub)
    return parser


def _add_generate(sub: Any, engine: argparse.ArgumentParser, output: argparse.ArgumentParser) -> None:
    gen = sub.add_parser(
        "generate",
        parents=[engine, _sampling_parent(), output],
        help="Complete one or more prompts (offline, continuous batching).",
        description="Complete one or more prompts. MODEL is optional: a first word that names a model ('smollm2', "
        "a .gguf file, a model folder) followed by a prompt is the model; or give --model.",
        usage="%(prog)s [MODEL] PROMPT [PROMPT ...] [options]",
    )
    gen.add_argument("words", nargs="+", metavar="PROMPT", help="The prompt(s), after an optional MODEL.")
    add_model_argument(gen, positional=False)
    gen.add_argument("--chat", action="store_true", help="Wrap each prompt in the model's chat template.")
    gen.set_defaults(func=cmd_generate)


def _add_startup(sub: Any, engine: argparse.ArgumentParser, output: argparse.ArgumentParser) -> None:
    start = sub.add_parser(
        "startup",
        parents=[engine, output],
        help="Start the engine to READY, print where the time went (the phase table) and exit.",
    )
    add_model_argument(start)
    _add_report_flags(start)
    start.add_argument(
        "--import-times",
        action="store_true",
        help="After READY, measure the imports row's top 5 packages (-X importtime in a fresh "
        "interpreter, ~2 s more) and note them on the row.",
    )
    start.add_argument(
        "--predict-only",
        action="store_true",
        help="Print the predicted phases and time to READY of this start without starting it (no "
        "torch import, no weight read): from the start-up profile's recorded starts and the "
        "start-up model. --report-out FILE.json writes it.",
    )
    start.add_argument(
        "--baseline",
        type=Path,
        metavar="FILE",
        help="After READY, compare each phase with this baseline (`glowplug bench startup "
        "--save-baseline FILE`) and exit 3 naming the phases that regressed beyond noise.",
    )
    start.add_argument(
        "--max-regression",
        default="10%",
        metavar="PCT",
        help="With --baseline: how much slower than the baseline's median a phase may be, on top of "
        "three sigmas of the baseline's own run-to-run noise (default 10%%).",
    )
    start.set_defaults(func=cmd_startup)


def _say(line: str) -> None:
    print(f"glowplug: {line}", file=sys.stderr, flush=True)


def _fail(code: int, line: str, exc: BaseException, verbose: bool) -> int:
    """One line on stderr (with --verbose, the traceback before it); returns the exit status."""
    if verbose:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    _say(line)
    return code


def _first_line(exc: BaseException) -> str:
    """`Type: message`, the whole first line: a fix at the end of a long message must not be cut off."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command; every failure becomes one line and an exit status (see the module docstring)."""
    verbose = bool(getattr(args, "verbose", False))
    try:
        resolve_model_argument(args)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        return _failure(exc, verbose)


def _failure(exc: Exception, verbose: bool) -> int:
    """The exit status and line of a failed command (re-raises what is not ours to explain). The error types are
    imported here, once something failed: the stage protocol's module (OpenTelemetry) is not needed to succeed."""
    from pydantic import ValidationError

    from glowplug.base.artifacts import CacheDirUnusable
    from glowplug.base.errors import MissingExtra
    from glowplug.engine.config import ConfigError
    from glowplug.engine.models.arch import ModelError
    from glowplug.engine.stages.protocol import StartupFailed

    if isinstance(exc, StartupFailed):
        if isinstance(exc.cause, ConfigError):  # a setting the model cannot take, found in model_prepare
            return _fail(SETTING_ERROR, f"error: {exc.cause}", exc, verbose)
        hint = "" if verbose or isinstance(exc.cause, (ModelError, CacheDirUnusable)) else " (--verbose: traceback)"
        return _fail(
            STARTUP_FAILED,
            f"state FAILED: start-up failed in {exc.stage}: {_first_line(exc.cause)}{hint}",
            exc,
            verbose,
        )
    if isinstance(exc, ValidationError):
        return _fail(SETTING_ERROR, f"invalid setting:\n{explain(exc)}", exc, verbose)
    if isinstance(exc, (ConfigError, FlagError, ModelError, CacheDirUnusable, MissingExtra, ValueError)):
        return _fail(SETTING_ERROR, f"error: {exc}", exc, verbose)
    raise exc


def main(argv: list[str] | None = None) -> int:
    from glowplug.profiling.process import mark_main_entry

    marks = mark_main_entry()  # the first moment our code runs: the end of the process_start row
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((w for w in words if not w.startswith("-")), None))
    args, extras = parser.parse_known_args(argv)
    if extras:
        # The command's own usage and error, not the top level's (argparse leaves them to the top otherwise).
        command_parser: CommandParser = getattr(args, "command_parser", parser)
        command_parser.error(f"unrecognized arguments: {' '.join(extras)}")
    args.marks = marks
    if args.func in (cmd_startup, cmd_serve):  # one engine per process: see FullGcDeferral
        marks.defer_full_gc()
    args.argv = list(words)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
