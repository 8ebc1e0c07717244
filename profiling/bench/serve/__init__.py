"""`glowplug bench serve`: load against an OpenAI-compatible server, in the spirit of vLLM's serving benchmark.

Modes (the sweep when none is given; several may be combined):
  (sweep)       each --concurrency (closed loop), then each --request-rate (open loop: --arrival poisson, burst or
                constant), --runs times: TTFT, TPOT, ITL and E2E p50/p90/p99, request and token throughput,
                goodput under --slo-ttft-ms/--slo-tpot-ms, failures by type -> serve.{json,md}, serve_latency.png
  --soak        --soak-streams clients for --soak-duration s mixing n>1, logprobs, stop strings, chat and
                completions, --hangup-fraction of them hanging up mid-stream; then the server must show 0 errors,
                tokens = usage per stream, generation counter = completed + aborted tokens, no KV blocks or
                running requests left, RSS within 1.05x of its value after the first wave -> soak.{json,md}
  --efficiency  one request set over HTTP at --efficiency-concurrency and offline through LLM.generate, in one
                run, paired by run: server / offline token throughput (median >= 0.95, worst pair >= 0.90)
                -> efficiency.{json,md}
  --overload    capacity (closed loop at max-num-seqs), the sustainable rate (--sustainable-load x capacity), then
                --overload-factor x that rate against a second server with admission by expected wait, --runs
                pairs back to back: 429s with Retry-After, each pair's p99 TTFT of admitted requests over its
                sustainable run's (worst pair <= 2) -> overload.{json,md,png}
  --fuzz        schemathesis over the server's own OpenAPI document, --fuzz-cases per generation endpoint, each
                case's work bounded (--fuzz-max-tokens, --fuzz-max-n, --fuzz-max-prompt-chars/-items) at the
                server's own limits: 5xx and schema violations by check -> fuzz.{json,md}
  --hostile     a --hostile-prompt-mb prompt refused while --hostile-streams stream (/health/ready p99, inter-token
                p99 against a quiet window, RSS growth against the body), the tokenizer's hold on other threads,
                the hostile corpus (sizes, depths, encodings, slow bodies, idle connections, API keys) with 0 5xx,
                and the limits' cost on throughput in paired runs -> hostile.{json,md}
  --structured  TPOT of 16 streams with 8 constrained (json_schema) against 16 unconstrained, interleaved pairs
                (worst <= 1.05); a grammar's extra TTFT, new schema (<= 50 ms) and repeated (<= 5 ms); llguidance's
                own times; --structured-objects objects over 20 schemas that must all validate, and with
                --real-model the same plus tool calls (auto, required, named) -> structured.{json,md}
Without --base-url the benchmark starts `python -m glowplug.lifecycle` on 127.0.0.1 with the engine flags given
here and stops it (SIGTERM) at the end. All traffic goes to that one address; every loop is bounded in requests
and in time.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from glowplug.profiling.bench.cli_support import AddModelFlags, add_command, prepare_out_dir, write_json

from .config import ServeBenchConfig

Progress = Callable[[str], None]


@contextmanager
def server_for(cfg: ServeBenchConfig, **serve_overrides: Any) -> Iterator[tuple[str, int | None]]:
    """(base URL, server pid or None): --base-url as given, else a server started here for the duration."""
    if cfg.base_url is not None:
        yield cfg.base_url.rstrip("/"), None
        return
    from .server import StartedServer

    with StartedServer(cfg, **serve_overrides) as srv:
        yield srv.base_url, srv.pid


def load_bench_tokenizer(model: str) -> Any:
    from glowplug.engine.models.store import resolve_model
    from glowplug.engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(model, quiet=True))


def sweep_mode(cfg: ServeBenchConfig, tokenizer: Any, argv: list[str] | None, say: Progress) -> list[Path]:
    from glowplug.profiling.bench.machine import report_header

    from .report import plot_sweep, render_sweep, sweep_json, workload_lines
    from .server import served_model
    from .sweep import run_sweep
    from .workload import build_requests, length_summary

    out = prepare_out_dir(cfg.out_dir)
    with server_for(cfg) as (base_url, _pid):
        model = cfg.served_model_name or served_model(base_url)
        points = run_sweep(cfg, base_url, tokenizer, model, say)
    lengths = length_summary(build_requests(cfg, tokenizer, max(cfg.num_prompts, 2 * max(cfg.concurrency, default=1))))
    head = report_header("Serving benchmark: latency and throughput under load", argv)
    text = render_sweep(cfg, points, head, workload_lines(cfg, lengths, model, base_url, cfg.base_url is None))
    (out / "serve.md").write_text(text)
    write_json(out / "serve.json", sweep_json(cfg, points, lengths, model))
    written = [out / "serve.md", out / "serve.json"]
    if cfg.plots:
        written.append(plot_sweep(cfg, points, out / "serve_latency.png"))
    print(text)
    return written


def main(cfg: ServeBenchConfig, argv: list[str] | None = None) -> int:
    from rich.console import Console

    from glowplug.profiling.logs import configure_logging

    configure_logging(level="warning")
    err = Console(stderr=True)

    def say(msg: str) -> None:
        err.print(msg, markup=False)

    tokenizer = load_bench_tokenizer(cfg.model)
    written: list[Path] = []
    ok = True
    for mode in cfg.modes:
        if mode == "sweep":
            written += sweep_mode(cfg, tokenizer, argv, say)
        else:
            # Every other mode is checked: module .<mode>'s <mode>_mode(cfg, tokenizer, argv, say, server_for) runs
            # it and gives its verdict and the files it wrote (imported here: each mode pulls in its own libraries).
            run_mode = getattr(importlib.import_module(f"{__name__}.{mode}"), f"{mode}_mode")
            passed, paths = run_mode(cfg, tokenizer, argv, say, server_for)
            ok &= passed
            written += paths
    say("wrote " + ", ".join(map(str, written)))
    return 0 if ok else 1


def register(subparsers: Any, add_model_flags: AddModelFlags) -> Any:
    return add_command(
        subparsers,
        "serve",
        help_text="Load against the HTTP server: latency percentiles, throughput, goodput; soak, efficiency, "
        "overload, fuzz, hostile and structured modes.",
        description=__doc__,
        config_cls=ServeBenchConfig,
        add_model_flags=add_model_flags,
        runner=main,
    )


__all__ = ["ServeBenchConfig", "main", "register", "write_json"]
