"""Server efficiency: one request set served over HTTP at high concurrency and run offline through `LLM.generate`,
in one command, with the same engine settings. Target: server output-token throughput / offline, paired by run:
median >= 0.92 and the worst pair >= 0.88.

Order: the server (its own process) starts and the offline engine is built in this process; both are warmed up.
Then each run is a pair, one after the other: the set over HTTP, then the same set through LLM.generate. The two
never run at the same time, so neither steals the other's cores, and the two halves of a pair see the same machine
(the memory bandwidth of a shared host drifts by tens of percent over minutes). Each pair's ratio divides the server
run by its own offline run; the verdict reads the median and the worst pair, never a median over a median.

Where the difference goes: the server's `glowplug_engine_step_duration_seconds` (sum, count) over each run against
the offline engine's own steps in the paired offline run (each offline run is LLM.generate's own loop, written out
here with a clock around each step, so the step figures have one value per run, not one extra pass) separates
"the steps got slower" (GIL or CPU contention with the event loop) from "the engine sat idle between steps"
(waiting on the event loop for new requests).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from glowplug.profiling.names import Metric

from .client import request_body
from .config import ServeBenchConfig
from .server import engine_fields, scrape, served_model
from .sweep import send_closed
from .workload import build_requests

TARGET_MEDIAN = 0.92  # median of the per-pair ratios (the issue "engine core in its own process")
TARGET_WORST = 0.88  # the worst pair
STEP_METRIC = Metric.ENGINE_STEP
SERVER_CPU = "process_cpu_seconds_total"  # the API server process
CORE_CPU = f"{Metric.ENGINE_CORE}_process_cpu_seconds_total"  # its engine core process


@dataclass
class ServerRun:
    wall_s: float
    output_tokens: int
    failed: int
    steps: float
    step_time_s: float
    client_cpu_s: float = 0.0  # CPU time this (the load generator's) process used during the run
    cores: int = 1  # cores this benchmark may run on
    server_cpu_s: float = 0.0  # the API server process's CPU time over the run (its /metrics)
    core_cpu_s: float = 0.0  # the engine core process's (0: the server reports none)

    @property
    def ceiling(self) -> float:
        """The best server / offline ratio this run allows: the load generator shares the machine with the server
        (the offline run has it alone), so the server gets at most the cores' time the client leaves."""
        return max(0.0, 1.0 - self.client_cpu_s / (self.cores * self.wall_s))

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_s


@dataclass
class OfflineRun:
    wall_s: float
    output_tokens: int
    steps: int = 0
    step_time_s: float = 0.0

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_s


@dataclass
class EfficiencyResult:
    requests: int
    input_len: int
    output_len: int
    concurrency: int
    server: list[ServerRun]
    offline: list[OfflineRun]

    @property
    def server_tps(self) -> float:
        return statistics.median(r.throughput for r in self.server)

    @property
    def offline_tps(self) -> float:
        return statistics.median(r.throughput for r in self.offline)

    @property
    def pair_ratios(self) -> list[float]:
        """Each server run divided by the offline run made right after it (same machine state)."""
        return [s.throughput / o.throughput for s, o in zip(self.server, self.offline, strict=True)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.pair_ratios)

    @property
    def worst_ratio(self) -> float:
        return min(self.pair_ratios)

    @property
    def passed(self) -> bool:
        return (
            self.ratio >= TARGET_MEDIAN and self.worst_ratio >= TARGET_WORST and all(r.failed == 0 for r in self.server)
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k not in ("server", "offline")},
            "server_runs": [{**asdict(r), "throughput": r.throughput, "ceiling": r.ceiling} for r in self.server],
            "client_ceiling": statistics.median(r.ceiling for r in self.server),
            "offline_runs": [{**asdict(r), "throughput": r.throughput} for r in self.offline],
            "server_tokens_per_s": self.server_tps,
            "offline_tokens_per_s": self.offline_tps,
            "pair_ratios": self.pair_ratios,
            "ratio": self.ratio,
            "worst_ratio": self.worst_ratio,
            "target_median": TARGET_MEDIAN,
            "target_worst": TARGET_WORST,
            "passed": self.passed,
        }


def _server_run(cfg: ServeBenchConfig, base_url: str, bodies: list[dict[str, Any]]) -> ServerRun:
    before = scrape(base_url)
    t0 = time.perf_counter()
    c0 = time.process_time()
    results = send_closed(cfg, base_url, bodies, cfg.efficiency_concurrency)
    client_cpu = time.process_time() - c0
    wall = time.perf_counter() - t0
    after = scrape(base_url)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return ServerRun(
        wall_s=wall,
        output_tokens=sum(r.output_tokens or 0 for r in results if r.ok),
        failed=sum(1 for r in results if not r.ok),
        steps=after.get(f"{STEP_METRIC}_count", 0.0) - before.get(f"{STEP_METRIC}_count", 0.0),
        step_time_s=after.get(f"{STEP_METRIC}_sum", 0.0) - before.get(f"{STEP_METRIC}_sum", 0.0),
        client_cpu_s=client_cpu,
        cores=cores,
        server_cpu_s=after.get(SERVER_CPU, 0.0) - before.get(SERVER_CPU, 0.0),
        core_cpu_s=after.get(CORE_CPU, 0.0) - before.get(CORE_CPU, 0.0),
    )


def _offline_run(llm: Any, prompts: list[str], params: Any) -> OfflineRun:
    """LLM.generate's loop (`LLM.add` the batch, step until done), with a clock around each step: the throughput is
    LLM.generate's, and the step count and busy time come from the same run (two perf_counter calls per step, a
    step being tens of ms, cost nothing measurable)."""
    engine = llm.engine
    t0 = time.perf_counter()
    order = llm.add(prompts, params)
    done: dict[str, Any] = {}
    steps, busy = 0, 0.0
    while engine.has_unfinished():
        s0 = time.perf_counter()
        outs = engine.step()
        busy += time.perf_counter() - s0
        steps += 1
        for out in outs:
            if out.finished:
                done[out.request_id] = out
    wall = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for rid in order for c in done[rid].outputs)
    return OfflineRun(wall, tokens, steps, busy)


def run_efficiency(
    cfg: ServeBenchConfig, tokenizer: Any, server_for: Any, say: Callable[[str], None]
) -> EfficiencyResult:
    import gc

    from glowplug.engine.config import EngineConfig
    from glowplug.engine.llm import LLM
    from glowplug.engine.sampling_params import SamplingParams

    if cfg.endpoint != "completions" or cfg.dataset is not None or cfg.len_distribution != "fixed":
        raise ValueError(
            "--efficiency runs the synthetic set of fixed lengths on /v1/completions (LLM.generate "
            "takes one SamplingParams); drop --dataset/--endpoint chat/--len-distribution"
        )
    count = max(cfg.num_prompts, cfg.efficiency_concurrency)
    specs = build_requests(cfg, tokenizer, count, seed=0)
    prompts = [s.prompt or "" for s in specs]
    params = SamplingParams(max_tokens=cfg.output_len, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos)
    server: list[ServerRun] = []
    offline: list[OfflineRun] = []
    with server_for(cfg) as (base_url, _pid):
        model = cfg.served_model_name or served_model(base_url)
        bodies = [request_body(s, model, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos) for s in specs]
        send_closed(cfg, base_url, bodies[: min(len(bodies), 4)], 4)  # warm-up
        say("efficiency: building the offline engine (the server waits, idle)")
        llm = LLM(config=EngineConfig.from_flat(**engine_fields(cfg)))
        llm.generate(prompts[:4], params)  # warm-up, like the server's
        for i in range(cfg.runs):
            say(
                f"efficiency: pair {i + 1}/{cfg.runs}: server ({len(bodies)} requests, concurrency "
                f"{cfg.efficiency_concurrency}), then offline (LLM.generate)"
            )
            server.append(_server_run(cfg, base_url, bodies))
            offline.append(_offline_run(llm, prompts, params))
    del llm
    gc.collect()
    return EfficiencyResult(count, cfg.input_len, cfg.output_len, cfg.efficiency_concurrency, server, offline)


def render_efficiency(r: EfficiencyResult, head: str) -> str:
    from glowplug.profiling.bench.tables import fmt_spread, markdown_table

    def spread(values: list[float]) -> str:
        return fmt_spread(values, 1)

    server_step = [s.step_time_s / s.steps * 1e3 for s in r.server if s.steps]
    server_busy = [s.step_time_s / s.wall_s for s in r.server]
    offline_step = [o.step_time_s / o.steps * 1e3 for o in r.offline if o.steps]
    offline_busy = [o.step_time_s / o.wall_s for o in r.offline]
    rows = [
        ["Output tokens/s", spread([s.throughput for s in r.server]), spread([o.throughput for o in r.offline])],
        ["Server / offline, per pair", ", ".join(f"{x:.3f}" for x in r.pair_ratios), "(each pair's denominator)"],
        ["Wall time (s)", spread([s.wall_s for s in r.server]), spread([o.wall_s for o in r.offline])],
        ["Engine steps", spread([s.steps for s in r.server]), spread([o.steps for o in r.offline])],
        [
            "Mean step (ms)",
            spread(server_step) if server_step else "no step recorded",
            spread(offline_step) if offline_step else "no step recorded",
        ],
        [
            "Engine busy, % (step time / wall)",
            spread([b * 100 for b in server_busy]),
            spread([b * 100 for b in offline_busy]),
        ],
        [
            "CPU cores busy: API server / engine core",
            " / ".join(
                fmt_spread([getattr(s, f) / s.wall_s for s in r.server], 2) for f in ("server_cpu_s", "core_cpu_s")
            ),
            "(one process)",
        ],
    ]
    verdict = "PASS" if r.passed else "FAIL"
    return "\n".join(
        [
            head,
            f"- request set: {r.requests} synthetic prompts of {r.input_len} tokens, {r.output_len} output tokens each "
            f"(EOS ignored), greedy; server: streaming /v1/completions at concurrency {r.concurrency}; offline: "
            "LLM.generate over the same prompts, right after each server run (one pair per run); medians over runs "
            "(min–max)",
            f"- **server / offline output-token throughput, paired by run: median {r.ratio:.3f}, worst pair "
            f"{r.worst_ratio:.3f}** (targets: median >= {TARGET_MEDIAN}, worst pair >= {TARGET_WORST}): **{verdict}**",
            f"- ceiling from the load generator's own CPU: median {statistics.median(s.ceiling for s in r.server):.3f} "
            f"(per run {', '.join(f'{s.ceiling:.3f}' for s in r.server)}): this process used "
            f"{statistics.median(s.client_cpu_s / s.wall_s for s in r.server):.2f} of the {r.server[0].cores} cores "
            "during each server run, time the offline run has for the engine",
            "",
            markdown_table(["", "Server (HTTP)", "Offline (LLM.generate)"], rows),
            "",
            f"Definitions (n = {len(r.server)} pairs): output tokens/s = output tokens / wall time of one run; "
            "server / "
            "offline = server run i's tokens/s over offline run i's, the offline run made right after it on the same "
            "requests; the verdict needs the median of those ratios and the worst one within their targets. Engine "
            "steps and mean step: the server's `glowplug_engine_step_duration_seconds` count and sum over the run; "
            "offline, a clock around each step of the same run. Busy = step time / wall time.",
            "",
            "Mean step: a server step slower than the offline one means the engine core lost time to the API server "
            "(CPU); server busy below the offline busy means it sat idle between steps waiting for work. "
            "CPU cores busy: each process's CPU seconds over the run (its /metrics) / wall time: an API server far "
            "below the core is not what limits the throughput.",
            "",
        ]
    )


def efficiency_mode(
    cfg: ServeBenchConfig, tokenizer: Any, argv: list[str] | None, say: Callable[[str], None], server_for: Any
) -> tuple[bool, list[Path]]:
    from glowplug.profiling.bench.cli_support import prepare_out_dir
    from glowplug.profiling.bench.machine import report_header

    from .report import write_mode_report

    out = prepare_out_dir(cfg.out_dir)
    result = run_efficiency(cfg, tokenizer, server_for, say)
    text = render_efficiency(result, report_header("Serving efficiency: HTTP server vs offline", argv))
    return result.passed, write_mode_report(cfg, out, "efficiency", text, result.as_dict())
