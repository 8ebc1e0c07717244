"""The load-point sweep: each concurrency (closed loop), then each request rate (open loop), `runs` times each.

A concurrency point sends max(num_prompts, 2 x concurrency) requests, so that the server spends most of the run at
that concurrency rather than ramping up and down. Each run of each point uses a fresh request set (seeded by the
point's place in the sweep and the run number), so neither runs nor points replay each other's prompts into the
prefix cache: a point that found an earlier point's prompts cached would compute one block of each, and a larger
point's extra requests whole prompts, so points would differ in prompt work, not only in load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .client import RequestResult, request_body
from .config import ServeBenchConfig
from .load import api_path, run_closed, run_open
from .results import LoadPoint, RunMetrics, Slo, run_metrics
from .workload import RequestSpec, arrival_times, build_requests

Progress = Callable[[str], None]


def bodies_for(cfg: ServeBenchConfig, specs: list[RequestSpec], model: str | None) -> list[dict[str, Any]]:
    return [request_body(s, model, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos) for s in specs]


def send_closed(
    cfg: ServeBenchConfig, base_url: str, bodies: list[dict[str, Any]], concurrency: int
) -> list[RequestResult]:
    """`bodies` sent by `concurrency` clients in a closed loop to the config's endpoint, within its time limits."""
    return run_closed(
        base_url,
        api_path(cfg.endpoint),
        bodies,
        concurrency,
        max_duration=cfg.max_duration,
        timeout=cfg.request_timeout,
    )


def warm_up(cfg: ServeBenchConfig, base_url: str, tokenizer: Any, model: str | None) -> None:
    if cfg.warmup_requests:
        specs = build_requests(cfg, tokenizer, cfg.warmup_requests, seed=10_000)
        send_closed(cfg, base_url, bodies_for(cfg, specs, model), cfg.warmup_requests)


def concurrency_point(
    cfg: ServeBenchConfig,
    base_url: str,
    tokenizer: Any,
    model: str | None,
    concurrency: int,
    say: Progress,
    *,
    seed_base: int = 0,
) -> LoadPoint:
    """`seed_base`: run i sends the request set of seed seed_base + i (run_sweep gives each point its own range)."""
    count = max(cfg.num_prompts, 2 * concurrency)
    slo = Slo(cfg.slo_ttft_ms, cfg.slo_tpot_ms)
    runs = []
    for run in range(cfg.runs):
        say(f"concurrency {concurrency}: run {run + 1}/{cfg.runs} ({count} requests)")
        specs = build_requests(cfg, tokenizer, count, seed=seed_base + run)
        runs.append(run_metrics(send_closed(cfg, base_url, bodies_for(cfg, specs, model), concurrency), slo))
    return LoadPoint("concurrency", concurrency, None, runs)


def rate_run(
    cfg: ServeBenchConfig, base_url: str, tokenizer: Any, model: str | None, rate: float, count: int, seed: int
) -> tuple[RunMetrics, list[RequestResult]]:
    """One open-loop run (Poisson, or --arrival) of `count` requests at `rate`, with its raw results (the overload
    mode reads their Retry-After headers)."""
    specs = build_requests(cfg, tokenizer, count, seed=seed)
    offsets = arrival_times(count, rate, cfg.arrival, cfg.burst_size, seed=seed)
    results = run_open(
        base_url,
        api_path(cfg.endpoint),
        bodies_for(cfg, specs, model),
        offsets,
        max_duration=cfg.max_duration,
        timeout=cfg.request_timeout,
    )
    return run_metrics(results, Slo(cfg.slo_ttft_ms, cfg.slo_tpot_ms)), results


def rate_point(
    cfg: ServeBenchConfig,
    base_url: str,
    tokenizer: Any,
    model: str | None,
    rate: float,
    say: Progress,
    *,
    count: int | None = None,
    seed_base: int = 0,
) -> tuple[LoadPoint, list[list[Any]]]:
    """One open-loop point; also returns each run's raw results (the overload mode reads their Retry-After).
    `seed_base`: as in `concurrency_point`."""
    count = count or cfg.num_prompts
    runs, raw = [], []
    for run in range(cfg.runs):
        say(f"{rate:g} req/s ({cfg.arrival}): run {run + 1}/{cfg.runs} ({count} requests)")
        metrics, results = rate_run(cfg, base_url, tokenizer, model, rate, count, seed_base + run)
        runs.append(metrics)
        raw.append(results)
    return LoadPoint("rate", rate, cfg.arrival, runs), raw


def run_sweep(
    cfg: ServeBenchConfig, base_url: str, tokenizer: Any, model: str | None, say: Progress
) -> list[LoadPoint]:
    """Every point of the sweep, in order; point k's runs use seeds k x runs, k x runs + 1, ... (module docstring)."""
    warm_up(cfg, base_url, tokenizer, model)
    points = [
        concurrency_point(cfg, base_url, tokenizer, model, c, say, seed_base=k * cfg.runs)
        for k, c in enumerate(cfg.concurrency)
    ]
    first_rate = len(cfg.concurrency)
    points += [
        rate_point(cfg, base_url, tokenizer, model, r, say, seed_base=(first_rate + k) * cfg.runs)[0]
        for k, r in enumerate(cfg.request_rate)
    ]
    return points
