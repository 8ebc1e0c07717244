"""The `glowplug` command. Heavy imports (torch, transformers) happen inside the commands, after the entry
timestamp is taken, so the start-up table can show the interpreter start and the imports as rows of their own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from .base.flags import FlagError, add_model_flags, explain, load_config_file

Command = Callable[[argparse.Namespace], int]

GENERATE_DEFAULTS: dict[str, Any] = {"temperature": 0.0, "max_tokens": 64}


def _engine_parent() -> argparse.ArgumentParser:
    from glowplug.engine.config import EngineConfig

    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine (one flag per EngineConfig field)")
    g.add_argument("--config", type=Path, help="A .json or .toml file of engine flags (flags given here win).")
    add_model_flags(g, EngineConfig, exclude={"model"})
    return p


def _sampling_parent(defaults: dict[str, Any]) -> argparse.ArgumentParser:
    from glowplug.engine.sampling_params import SamplingParams

    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sampling (one flag per SamplingParams field)")
    # --seed belongs to the engine: it seeds every request that does not bring its own seed.
    add_model_flags(g, SamplingParams, exclude={"seed"}, defaults=defaults)
    return p


def engine_config(args: argparse.Namespace) -> Any:
    from glowplug.engine.config import EngineConfig, SchedulerConfig, CacheConfig, QuantConfig

    fields: dict[str, Any] = {}
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
    return EngineConfig.from_flat(**fields)


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any]) -> Any:
    from glowplug.engine.sampling_params import SamplingParams

    given = {k: v for k, v in vars(args).items() if k in SamplingParams.model_fields and k != "seed"}
    fields = {**defaults, **given}
    return SamplingParams(**fields)


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from glowplug.engine.llm import LLM
    from glowplug.profiling.logs import configure_logging

    # Start-up stage logs would interleave with the generated text; warnings and errors still show.
    configure_logging(level="warning")
    config = engine_config(args)
    params = sampling_params(args, GENERATE_DEFAULTS)
    llm = LLM(config=config)
    out = Console(soft_wrap=True, highlight=False)
    if len(args.prompts) == 1 and params.n == 1:
        out.print(args.prompts[0] if not args.chat else f"[dim]{args.prompts[0]}[/dim]\n", end="", style="bold")
        last = None
        for update in llm.stream(args.prompts, params, chat=args.chat):
            out.print(update.outputs[0].delta, end="", markup=False)
            last = update
        reason = last.outputs[0].finish_reason if last else None
        out.print(f"\n[dim](finish_reason={reason})[/dim]")
        return 0
    for res in llm.generate(args.prompts, params, chat=args.chat):
        for c in res.outputs:
            out.rule(f"prompt: {res.prompt!r}  completion {c.index}  finish_reason={c.finish_reason}")
            out.print(c.text, markup=False)
    return 0


def cmd_startup(args: argparse.Namespace) -> int:
    """Run the start-up pipeline to READY, print the phase table, write the requested reports, exit."""
    from rich.console import Console

    from glowplug.profiling.logs import configure_logging
    from glowplug.profiling.tracing import setup_tracing

    configure_logging(level=args.log_level)
    config = engine_config(args)
    import importlib
    import time

    from glowplug.profiling.imports import STARTUP_IMPORTS

    # torch first and timed on its own: the floor's `import torch` term. transformers is not imported here: the
    # stage that needs it imports it, alongside the weights loading on another thread.
    t0 = time.perf_counter()
    import torch  # noqa: F401

    args.marks.import_torch_s = time.perf_counter() - t0
    for module in STARTUP_IMPORTS:
        importlib.import_module(module)
    from glowplug.engine.startup import StartupFailed, build_engine
    from glowplug.profiling import export, phases
    from glowplug.profiling.names import STARTUP_SPAN, Row

    args.marks.mark_imports_done()
    tracing = setup_tracing()
    failed: StartupFailed | None = None
    try:
        table = build_engine(config, tracing=tracing, marks=args.marks).phase_table
        # For whoever times this process from outside (tests, benchmarks): READY has been reached.
        print("glowplug: READY", file=sys.stderr, flush=True)
    except StartupFailed as exc:
        failed = exc
        # The failed stage's span is finished too: the table and traces show how far the start got.
        table = phases.build_phase_table([s for s in tracing.finished_spans() if s.name.startswith(STARTUP_SPAN)])
    if args.import_times and failed is None:
        from glowplug.profiling.imports import measure_import_costs, top_note
        from glowplug.profiling.names import Attr

        costs = measure_import_costs()
        table = phases.with_row_note(table, Row.IMPORTS, top_note(costs),
                                     {Attr.IMPORT_TOP: [f"{c.package} {c.self_s:.3f}" for c in costs[:5]]})  # fmt: skip
    spans = list(tracing.finished_spans())
    if args.report_out:
        phases.write_report(table, args.report_out)
    if args.trace_out:
        export.write_otlp_json(spans, args.trace_out)
    if args.chrome_trace:
        export.write_chrome_trace(spans, args.chrome_trace)
    tracing.shutdown()  # flushes any OTLP exporter
    if failed is not None:
        Console(stderr=True).print(f"glowplug: state FAILED: {failed}", markup=False, soft_wrap=True)
        return 1
    Console().print(phases.to_rich(table))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from glowplug.lifecycle.config import serve_config_from_args
    from glowplug.lifecycle.server import exit_process, serve

    exit_process(serve(engine_config(args), serve_config_from_args(args), marks=args.marks))


def _bench_config(model_cls: Any, args: argparse.Namespace) -> Any:
    return model_cls(**{k: v for k, v in vars(args).items() if k in model_cls.model_fields})


def cmd_bench_decode(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markdown import Markdown

    from glowplug.profiling.bench.decode import DecodeBenchConfig, render_markdown, rows_as_dicts, run_decode_bench

    cfg = _bench_config(DecodeBenchConfig, args)
    rows = run_decode_bench(cfg)
    text = render_markdown(rows, cfg, args.argv)
    Console().print(Markdown(text))
    if cfg.out is not None:
        import json

        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        cfg.out.write_text(text)
        cfg.out.with_suffix(".json").write_text(json.dumps(rows_as_dicts(rows), indent=1))
    return 0


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
    p.add_argument("--report-out", type=_writable_file((".md", ".csv", ".json")), help="Phase table (.md/.csv/.json).")
    p.add_argument("--trace-out", type=_writable_file((".json",)), help="Spans as OTLP JSON.")
    p.add_argument("--chrome-trace", type=_writable_file((".json",)), help="Chrome/Perfetto trace-event JSON.")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _add_bench_commands(bench: argparse.ArgumentParser, tune_parser: argparse.ArgumentParser) -> None:
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    from glowplug.profiling.bench.decode import DecodeBenchConfig

    dec = bsub.add_parser(
        "decode", help="Decode tokens/s per compile mode, dtype, quantization and batch size, vs transformers."
    )
    dec.add_argument("model", nargs="?", default="smollm2", metavar="MODEL")
    add_model_flags(dec, DecodeBenchConfig, exclude={"model"})
    dec.set_defaults(func=cmd_bench_decode)

    from glowplug.profiling.bench.accuracy import AccuracyConfig
    from glowplug.profiling.bench.cache_verify import CacheVerifyConfig, run_cache_verify_bench
    from glowplug.profiling.bench.kernel_bench import KernelBenchConfig, run_accuracy_report, run_kernel_bench

    for name, cls, run, text in (
        ("kernels", KernelBenchConfig, run_kernel_bench, "Every quantized linear path per M on the model's shapes."),
        ("accuracy", AccuracyConfig, run_accuracy_report, "Perplexity, KL and top-1 agreement of each scheme vs bf16."),
        ("cache-verify", CacheVerifyConfig, run_cache_verify_bench, "Cost of verifying a warm cache hit, quick vs full."),
    ):
        p = bsub.add_parser(name, help=text)
        p.add_argument("model", nargs="?", default="smollm2", metavar="MODEL")
        add_model_flags(p, cls, exclude={"model"})
        p.set_defaults(func=_report_command(cls, run))

    from glowplug.profiling.bench import all as bench_all
    from glowplug.profiling.bench import latency, startup_bench, throughput, tune
    from glowplug.profiling.bench import serve as serve_bench

    for module in (latency, throughput, startup_bench, serve_bench, bench_all):
        module.register(bsub, add_model_flags)
    tsub = tune_parser.add_subparsers(dest="tune_command", required=True, metavar="TUNE")
    tune.register(tsub, add_model_flags)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI. `command` (the first word of the command line) skips building the bench and tune commands'
    flags when another command runs: they import every benchmark's config, a visible share of `glowplug startup`'s
    imports row. None builds everything (help, docs, tests)."""
    parser = argparse.ArgumentParser(prog="glowplug", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    engine = _engine_parent()

    gen = sub.add_parser(
        "generate",
        parents=[engine, _sampling_parent(GENERATE_DEFAULTS)],
        help="Generate text for one or more prompts (offline, continuous batching).",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--model", default="smollm2", help="'smollm2' (embedded default), a HF folder or a .gguf file.")
    gen.add_argument("--chat", action="store_true", help="Wrap each prompt in the model's chat template.")
    gen.set_defaults(func=cmd_generate)

    start = sub.add_parser(
        "startup", parents=[engine], help="Run the start-up pipeline to READY, print the phase table and exit."
    )
    start.add_argument("model", nargs="?", default="smollm2", metavar="MODEL")
    _add_report_flags(start)
    start.add_argument("--import-times", action="store_true",
                       help="After READY, measure the imports row's top 5 packages (-X importtime in a fresh "
                            "interpreter, ~2 s more) and note them on the row.")  # fmt: skip
    start.set_defaults(func=cmd_startup)

    from glowplug.lifecycle.config import add_serve_flags

    srv = sub.add_parser("serve", parents=[engine], help="OpenAI-compatible HTTP server (starts through the stages).")
    srv.add_argument("model", nargs="?", default="smollm2", metavar="MODEL")
    add_serve_flags(srv.add_argument_group("serving (one flag per ServeConfig field)"))
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="Benchmarks; reports go where --out/--out-dir says (default: ./<command>/).")
    tune = sub.add_parser("tune", help="Tune start-up settings (max-model-len sweeps).")
    if command in (None, "bench", "tune"):  # their flags come from the benchmarks' configs: imported only for them
        _add_bench_commands(bench, tune)

    from glowplug import cache_cli

    cache_cli.register(sub)

    models = sub.add_parser("models", help="Manage model files.")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    prep = msub.add_parser("prepare", help="Convert the embedded default model into the cache (done on first use).")
    prep.add_argument("model", nargs="?", default="smollm2")
    prep.set_defaults(func=cmd_models_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    from glowplug.profiling.process import mark_main_entry

    marks = mark_main_entry()  # the first moment our code runs: the end of the process_start row
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((w for w in words if not w.startswith("-")), None))
    args = parser.parse_args(argv)
    args.marks = marks
    if args.func in (cmd_startup, cmd_serve):  # one engine per process: see FullGcDeferral
        marks.defer_full_gc()
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from pydantic import ValidationError

    from glowplug.base.artifacts import CacheDirUnusable
    from glowplug.base.errors import MissingExtra
    from glowplug.engine.models.arch import ModelError
    from glowplug.engine.stages.base import StartupFailed

    func: Command = args.func
    try:
        return func(args)
    except StartupFailed as exc:
        print(f"glowplug: state FAILED: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        print(f"glowplug: invalid setting:\n{explain(exc)}", file=sys.stderr)
        return 2
    except (FlagError, ModelError, ValueError, CacheDirUnusable, MissingExtra) as exc:
        print(f"glowplug: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
