"""The soak: many concurrent streams for minutes, a mix of every feature, some clients hanging up; then the server
must be exactly as clean as before and no bigger than after the first wave.

The mix (round-robin per client): completions (plain, n=2 sampled, top-3 logprobs, stop strings) and chat (plain,
n=2 sampled, stop strings). Every request asks for per-token logprobs (top 0 where the mix has none), so the tokens a
stream carried can be counted exactly and compared with its usage. `hangup_fraction` of the clients are hang-up
clients: their requests ask for many tokens (EOS ignored) and they close the connection after a few chunks.

Checks, read from the server's own /metrics once it is idle:
  errors            0: every other request ended with stop/length, [DONE] and a usage
  tokens == usage   for every finished stream (choices summed)
  counter           glowplug_generation_tokens grew by the tokens of the requests the server ended
                    (glowplug_completed_generation_tokens) plus those of aborted ones (glowplug_aborted_generation_
                    tokens: what the hung-up clients had generated when they left)
  usages            the sum of the usages the clients read is at most the completed tokens, and equal to them when
                    no client hangs up: a hang-up client can leave after the server sent its end
  idle              KV blocks in use 0, running 0, waiting 0
  memory            RSS after the soak <= 1.05 x the RSS after the first full wave (every client done once): the API
                    server's plus, when it reports one, its engine core process's (glowplug serve runs two).
                    Both are read with the server idle for IDLE_S: after the first wave every client waits at a
                    barrier until that reading is taken (the pause does not count toward the soak's duration). An idle
                    glowplug engine core hands its heap's free pages back (engine/core_proc.py), so reading both
                    at rest compares what the server holds, not where its allocator stood mid-step. The readings
                    under load (as the first wave ends, and as the last request ends) are reported beside them.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from glowplug.profiling.names import Metric

from .client import RequestResult, make_client, send_streaming
from .server import parse_metrics
from .workload import WORDS

RSS_LIMIT = 1.05
RSS_METRIC = "process_resident_memory_bytes"
CORE_RSS_METRIC = f"{Metric.ENGINE_CORE}_process_resident_memory_bytes"
# Longer than the engine core's idle trim delay (engine.core_proc.IDLE_TRIM_S), so both readings are at rest.
IDLE_S = 2.5
KINDS = ("completion", "completion_n2", "completion_top3", "completion_stop", "chat", "chat_n2", "chat_stop")


@dataclass(frozen=True)
class SoakPlan:
    streams: int = 64
    duration_s: float = 120.0
    hangup_fraction: float = 0.1
    max_tokens: tuple[int, int] = (16, 64)  # per request, uniform
    hangup_max_tokens: int = 512
    hangup_after_chunks: tuple[int, int] = (2, 6)
    model: str | None = None
    seed: int = 0
    request_timeout: float = 300.0
    settle_timeout_s: float = 60.0

    @property
    def hangup_clients(self) -> int:
        return round(self.streams * self.hangup_fraction)


@dataclass
class Check:
    name: str
    value: str
    limit: str
    passed: bool


@dataclass
class SoakResult:
    plan: SoakPlan
    wall_s: float
    requests: int
    finished: int
    hung_up: int
    errors: dict[str, int]
    by_kind: dict[str, int]
    usage_tokens: int
    streamed_mismatches: list[dict[str, Any]]
    counter_delta: float
    aborted_delta: float
    rss_first_wave: float | None
    rss_end: float | None
    idle_metrics: dict[str, float]
    rss_first_wave_load: float | None = None  # the same readings under load, for the report
    rss_end_load: float | None = None
    checks: list[Check] = field(default_factory=list)
    results: list[RequestResult] = field(default_factory=list, repr=False)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("results")
        out["passed"] = self.passed
        return out


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(12, 40)))


def soak_body(kind: str, rng: random.Random, plan: SoakPlan) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": rng.randint(*plan.max_tokens),
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if plan.model is not None:
        body["model"] = plan.model
    if kind.startswith("chat"):
        body["messages"] = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": _prompt(rng)}]
        body["logprobs"] = True
        body["top_logprobs"] = 0
    else:
        body["prompt"] = _prompt(rng)
        body["logprobs"] = 3 if kind == "completion_top3" else 0
    if kind.endswith("_n2"):
        body.update(n=2, temperature=0.8, seed=rng.randint(0, 2**31))
    if kind.endswith("_stop"):
        body["stop"] = [" the", "."]
    else:
        body["ignore_eos"] = True
    return body


def hangup_body(rng: random.Random, plan: SoakPlan) -> dict[str, Any]:
    body = soak_body("completion", rng, plan)
    body["max_tokens"] = plan.hangup_max_tokens
    return body


def _kind_of(body: dict[str, Any]) -> str:
    base = "chat" if "messages" in body else "completion"
    if body.get("n") == 2:
        return base + "_n2"
    if "stop" in body:
        return base + "_stop"
    if body.get("logprobs") == 3:
        return base + "_top3"
    return base


def _rss(sample: dict[str, float]) -> float | None:
    """The server's resident memory, its engine core's included when it reports one."""
    server = sample.get(RSS_METRIC)
    return None if server is None else server + sample.get(CORE_RSS_METRIC, 0.0)


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    return parse_metrics((await client.get("/metrics")).text)


async def _settle(client: httpx.AsyncClient, timeout: float) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds KV blocks (or as it stands after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await _scrape(client)
        idle = all(
            m.get(k, 0.0) == 0.0 for k in (Metric.REQUESTS_RUNNING, Metric.REQUESTS_WAITING, Metric.KV_USED_BLOCKS)
        )
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)


async def _at_rest(client: httpx.AsyncClient, timeout: float) -> dict[str, float]:
    """/metrics once the server has been idle for IDLE_S."""
    await _settle(client, timeout)
    await asyncio.sleep(IDLE_S)
    return await _settle(client, timeout)


async def run_soak_async(base_url: str, plan: SoakPlan, progress: Callable[[str], None] | None = None) -> SoakResult:
    say = progress or (lambda _m: None)
    path = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
    results: list[tuple[str, RequestResult]] = []
    first_wave = asyncio.Event()
    done_clients: set[int] = set()
    numbers = itertools.count()
    resume = asyncio.Event()
    rss: dict[str, float | None] = {}
    async with make_client(base_url, plan.streams + 4, plan.request_timeout) as client:
        before = await _settle(client, plan.settle_timeout_s)
        deadline = [time.monotonic() + plan.duration_s]  # moved on by the pause after the first wave
        t0 = time.perf_counter()

        async def client_loop(c: int) -> None:
            rng = random.Random(plan.seed * 10_007 + c)
            hangs = c < plan.hangup_clients
            i = 0
            while time.monotonic() < deadline[0]:
                kind = KINDS[(c + i) % len(KINDS)]
                body = hangup_body(rng, plan) if hangs else soak_body(kind, rng, plan)
                route = path["chat" if "messages" in body else "completion"]
                after = rng.randint(*plan.hangup_after_chunks) if hangs else None
                r = await send_streaming(client, route, body, next(numbers), hangup_after_chunks=after)
                results.append((_kind_of(body), r))
                i += 1
                if c not in done_clients:
                    done_clients.add(c)
                    if len(done_clients) == plan.streams:
                        first_wave.set()
                    await resume.wait()

        async def first_wave_rss() -> None:
            try:
                await asyncio.wait_for(first_wave.wait(), plan.duration_s)
            except asyncio.TimeoutError:
                resume.set()
                return
            paused = time.monotonic()
            rss["first_load"] = _rss(await _scrape(client))
            rss["first_idle"] = _rss(await _at_rest(client, plan.settle_timeout_s))
            deadline[0] += time.monotonic() - paused
            resume.set()

        say(f"soak: {plan.streams} streams ({plan.hangup_clients} hang up) for {plan.duration_s:g} s")
        rss_task = asyncio.ensure_future(first_wave_rss())
        await asyncio.gather(*(client_loop(c) for c in range(plan.streams)))
        wall = time.perf_counter() - t0
        await rss_task
        settled = await _settle(client, plan.settle_timeout_s)
        after = await _at_rest(client, plan.settle_timeout_s)
    rss_loads = (rss.get("first_load"), _rss(settled))
    return _evaluate(plan, results, before, after, rss.get("first_idle"), wall, rss_loads)


def _evaluate(
    plan: SoakPlan,
    results: list[tuple[str, RequestResult]],
    before: dict[str, float],
    after: dict[str, float],
    rss_first: float | None,
    wall: float,
    rss_loads: tuple[float | None, float | None] = (None, None),
) -> SoakResult:
    finished = [r for _, r in results if r.ok]
    hung = [r for _, r in results if r.hung_up]
    failed = [r for _, r in results if not r.ok and not r.hung_up]
    bad_finish = [r for r in finished if set(r.finish_reasons.values()) - {"stop", "length"}]
    errors = Counter(r.error or "unknown" for r in failed)
    if bad_finish:
        errors["unexpected_finish_reason"] += len(bad_finish)
    mismatches = [
        {"index": r.index, "streamed": r.streamed_tokens, "usage": r.output_tokens}
        for r in finished
        if r.streamed_tokens != r.output_tokens
    ]
    usage = sum(r.output_tokens or 0 for r in finished)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    counter = delta(f"{Metric.GENERATION_TOKENS}_total")
    aborted = delta(f"{Metric.ABORTED_GENERATION_TOKENS}_total")
    # The server's own count of the tokens of requests it ended: a hang-up client can leave after the server sent
    # the end (its usage then never counts on the client's side), so the usages alone can fall short of it.
    completed = delta(f"{Metric.COMPLETED_GENERATION_TOKENS}_total")
    rss_end = _rss(after)
    idle = {k: after.get(k, 0.0) for k in (Metric.KV_USED_BLOCKS, Metric.REQUESTS_RUNNING, Metric.REQUESTS_WAITING)}
    result = SoakResult(
        plan=plan,
        wall_s=wall,
        requests=len(results),
        finished=len(finished),
        hung_up=len(hung),
        errors=dict(errors),
        by_kind=dict(Counter(k for k, _ in results)),
        usage_tokens=usage,
        streamed_mismatches=mismatches[:20],
        counter_delta=counter,
        aborted_delta=aborted,
        rss_first_wave=rss_first,
        rss_end=rss_end,
        idle_metrics=idle,
        rss_first_wave_load=rss_loads[0],
        rss_end_load=rss_loads[1],
        results=[r for _, r in results],
    )
    checks = [
        Check("errors", str(sum(errors.values())), "0", not errors),
        Check("finished streams with tokens != usage", str(len(mismatches)), "0", not mismatches and bool(finished)),
        Check(
            "generation_tokens counter delta",
            f"{counter:.0f}",
            f"= completed tokens {completed:.0f} + aborted tokens {aborted:.0f}",
            counter == completed + aborted,
        ),
        Check(
            "sum of usages the clients read",
            str(usage),
            f"<= completed tokens {completed:.0f}, and = them when no client hung up",
            usage <= completed and (bool(plan.hangup_clients) or usage == completed),
        ),
        Check(
            "hung-up clients' requests",
            str(len(hung)),
            ">= 1" if plan.hangup_clients else "0",
            bool(hung) if plan.hangup_clients else not hung,
        ),
    ]
    checks += [Check(k.removeprefix("glowplug_"), f"{v:.0f}", "0", v == 0.0) for k, v in idle.items()]
    if rss_first is None or rss_end is None:
        why = "the first wave did not finish within the soak" if rss_first is None else f"no {RSS_METRIC}"
        checks.append(Check("RSS end / first wave", why, f"<= {RSS_LIMIT}", False))
    else:
        ratio = rss_end / rss_first
        value = f"{ratio:.3f} ({rss_end / 2**20:.0f} / {rss_first / 2**20:.0f} MiB at rest"
        first_load, end_load = rss_loads
        if first_load and end_load:
            value += f"; under load {end_load / 2**20:.0f} / {first_load / 2**20:.0f} MiB = {end_load / first_load:.3f}"
        checks.append(Check("RSS end / first wave", value + ")", f"<= {RSS_LIMIT}", ratio <= RSS_LIMIT))
    result.checks = checks
    return result


def run_soak(base_url: str, plan: SoakPlan, progress: Callable[[str], None] | None = None) -> SoakResult:
    return asyncio.run(run_soak_async(base_url, plan, progress))


def render_soak(result: SoakResult, head: str, latency_table: str) -> str:
    from glowplug.profiling.bench.tables import markdown_table

    p = result.plan
    rows = [[c.name, c.value, c.limit, "pass" if c.passed else "FAIL"] for c in result.checks]
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(result.by_kind.items()))
    return "\n".join(
        [
            head,
            f"- {p.streams} concurrent streams for {p.duration_s:g} s ({result.wall_s:.1f} s with the last requests), "
            f"{p.hangup_clients} of them hanging up after {p.hangup_after_chunks[0]}-{p.hangup_after_chunks[1]} chunks",
            f"- {result.requests} requests: {result.finished} finished, {result.hung_up} hung up on purpose; "
            f"mix: {kinds}",
            f"- verdict: **{'PASS' if result.passed else 'FAIL'}**",
            "",
            "## Checks (server /metrics once idle)",
            "",
            markdown_table(["Check", "Value", "Limit", "Result"], rows),
            "",
            "## Latency of the finished requests",
            "",
            latency_table,
            "",
        ]
    )


def soak_mode(
    cfg: Any, tokenizer: Any, argv: list[str] | None, say: Callable[[str], None], server_for: Any
) -> tuple[bool, list[Path]]:
    from glowplug.profiling.bench.cli_support import prepare_out_dir
    from glowplug.profiling.bench.machine import report_header

    from .report import latency_table, write_mode_report
    from .results import LoadPoint, run_metrics
    from .server import served_model

    out = prepare_out_dir(cfg.out_dir)
    with server_for(cfg) as (base_url, _pid):
        # Room for the longest prompt of the mix (a chat template around 40 words: under 160 tokens).
        room = _max_model_len(base_url) - 160
        if room < 32:
            raise ValueError(f"the soak needs a max-model-len of at least 192 (the server has {room + 160})")
        plan = SoakPlan(
            streams=cfg.soak_streams,
            duration_s=cfg.soak_duration,
            hangup_fraction=cfg.hangup_fraction,
            max_tokens=(16, min(64, room)),
            hangup_max_tokens=min(512, room),
            model=cfg.served_model_name or served_model(base_url),
            request_timeout=cfg.request_timeout,
        )
        result = run_soak(base_url, plan, say)
    point = LoadPoint("concurrency", plan.streams, None, [run_metrics(result.results)])
    text = render_soak(result, report_header("Serving soak", argv), latency_table_all(point, latency_table))
    return result.passed, write_mode_report(cfg, out, "soak", text, {**result.as_dict(), "metrics": point.as_dict()})


def _max_model_len(base_url: str) -> int:
    card = httpx.get(base_url + "/v1/models", timeout=10.0, trust_env=False).json()["data"][0]
    return int(card.get("max_model_len") or 2048)


def latency_table_all(point: Any, latency_table: Callable[[Any, str], str]) -> str:
    from .report import LATENCY_TITLES

    parts = []
    for metric, title in LATENCY_TITLES.items():
        parts += [f"### {title}", "", latency_table([point], metric), ""]
    return "\n".join(parts)
