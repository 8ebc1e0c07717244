"""`glowplug bench serve --hostile`: the server against hostile input, in four parts -> hostile.{json,md}.

1. Tokenizer hold (in this process, no server): a 10 ms timer on another thread, while a long prompt is tokenized
   whole (`Tokenizer.encode`, which holds the GIL throughout) and in bounded pieces (`encode_bounded`, which
   releases it): how late the timer fires.
2. A large prompt refused under load: a server with the default limits and an API key; --hostile-streams streams
   generating, /health/ready probed every 10 ms, the server's RSS sampled every 5 ms; after a quiet window, a
   --hostile-prompt-mb prompt ("hello world " repeated, as the issue sent it) is sent --hostile-refusals times
   in a row. Per run: /health/ready latency and the streams' inter-token gaps that overlap a refusal, against the
   same streams' gaps in the quiet window; RSS peak over its quiet level. Targets, met by the worst run: ready p99
   <= 100 ms, inter-token p99 <= 2x quiet (paired within the run), RSS growth <= 2x the body.
3. The hostile corpus (hostile_corpus.py) against that same server, with its default limits: every case a 4xx or
   a clean close, READY and a normal request succeeding after each; 0 responses 5xx.
4. The limits' cost on the normal path, paired: the server above against one with the limits off
   (--max-body-bytes 0 --body-read-timeout 0 --header-read-timeout 0, no key; the depth check stays, it cannot be
   turned off, and costs two `bytes.count` on a normal body), both running, each pair one closed-loop run on each
   in alternating order; the figure is each pair's throughput ratio.

Every server is a subprocess on 127.0.0.1; every loop is bounded in requests and in time.
"""

from __future__ import annotations

import math
import os
import secrets
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from .client import request_body
from .config import ServeBenchConfig
from .hostile_corpus import CorpusResult, Target, run_corpus
from .load import api_path, run_closed
from .workload import build_requests

Progress = Callable[[str], None]

READY_P99_TARGET_MS = 100.0
ITL_RATIO_TARGET = 1.5
RSS_RATIO_TARGET = 2.0
_PROBE_INTERVAL_S = 0.010
_RSS_INTERVAL_S = 0.005
_SETTLE_S = 2.0  # after every stream has its first token, before the quiet window: the streams' start is not quiet
_QUIET_S = 3.5  # the quiet window of each run
_QUIET_GUARD_S = 0.5  # between the quiet window's end and the first refusal: a gap spanning both is not quiet
_LIMITS_OFF = {"max_body_bytes": 0, "body_read_timeout": 0, "header_read_timeout": 0}
# Both servers admit without the expected-wait check (--max-queue-wait 30 s by default): on a loaded machine its
# 429s would land in one run of a pair and not the other, and they are admission, not a transport limit.
_NO_WAIT_LIMIT = {"max_queue_wait": 3600.0}
_API_KEY_ENV = "GLOWPLUG_API_KEY"


def _p(values: list[float], q: float) -> float:
    """The q-th percentile; NaN for no samples (a cell then says so, and no target is met by NaN)."""
    from glowplug.profiling.bench.stats import percentile

    return percentile(values, q) if values else math.nan


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _overlaps(a: float, b: float, windows: list[tuple[float, float]]) -> bool:
    return any(a <= w1 and b >= w0 for w0, w1 in windows)


# ---------------------------------------------------------------- 1. the tokenizer's hold on other threads


@dataclass
class HoldRun:
    chars: int
    whole_s: float
    whole_late_ms: float
    bounded_s: float
    bounded_late_ms: float


def _timer_lateness(work: Callable[[], object], interval: float = 0.010) -> tuple[float, float]:
    """(seconds `work` took, the worst lateness in ms of an `interval` timer on another thread meanwhile)."""
    late: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(interval)
            late.append(time.perf_counter() - t - interval)

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    try:
        work()
    finally:
        took = time.perf_counter() - t0
        stop.set()
        thread.join()
    return took, max(late) * 1000


def measure_hold(tokenizer: Any, chars: int, runs: int) -> list[HoldRun]:
    text = ("hello world " * (chars // 12 + 1))[:chars]
    out = []
    for _ in range(runs):
        whole_s, whole_late = _timer_lateness(lambda: tokenizer.encode(text))
        bounded_s, bounded_late = _timer_lateness(lambda: tokenizer.encode_bounded(text, limit=10**9))
        out.append(HoldRun(chars, whole_s, whole_late, bounded_s, bounded_late))
    return out


# ---------------------------------------------------------------- the checks' own cost on a normal request


@dataclass
class CheckCost:
    """Microseconds per normal request of each step the transport checks add, with what it replaces, measured in
    this process (no server, no network: what the pairs below cannot resolve under a machine's noise)."""

    body_bytes: int
    parse_us: float  # read into a BodyBuffer, depth/element scan, strict UTF-8, json.loads, Unicode check, pydantic
    parse_plain_us: float  # json.loads and pydantic alone (the path before)
    key_us: float  # the API key check (SHA-256 of the presented key, compare_digest)
    tokenize_us: float  # encode_bounded of the prompt
    tokenize_plain_us: float  # Tokenizer.encode of the prompt


def _per_call_us(fn: Callable[[], object], seconds: float = 0.5) -> float:
    """Median over 5 rounds of the mean time of one call, each round about `seconds / 5` long."""
    rounds = []
    for _ in range(5):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 5:
            fn()
            n += 1
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(rounds)


def measure_check_cost(tokenizer: Any, body: dict[str, Any]) -> CheckCost:
    import json

    from glowplug.lifecycle.config import ServeConfig
    from glowplug.lifecycle.metrics import ServiceMetrics
    from glowplug.lifecycle.protocol import CompletionRequest, parse_body
    from glowplug.lifecycle.transport import BodyBuffer, TransportGuard, TransportLimits

    raw = json.dumps(body).encode()
    cfg = ServeConfig(api_key="sk-" + "x" * 40)
    guard = TransportGuard(lambda *_a: None, limits=TransportLimits.from_config(cfg), metrics=ServiceMetrics())
    scope = {
        "type": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "headers": [(b"authorization", b"Bearer sk-" + b"x" * 40), (b"content-length", str(len(raw)).encode())],
    }

    def checked() -> object:
        buf = BodyBuffer(None)
        buf.append(raw)
        return parse_body(CompletionRequest, buf, cfg.max_json_depth, cfg.max_json_values)

    def plain() -> object:
        request = CompletionRequest.model_validate(json.loads(raw))
        request.check()
        return request

    prompt = str(body["prompt"])
    return CheckCost(
        body_bytes=len(raw),
        parse_us=_per_call_us(checked),
        parse_plain_us=_per_call_us(plain),
        key_us=_per_call_us(lambda: guard.refusal(scope)),
        tokenize_us=_per_call_us(lambda: tokenizer.encode_bounded(prompt, limit=10**9)),
        tokenize_plain_us=_per_call_us(lambda: tokenizer.encode(prompt)),
    )


# ---------------------------------------------------------------- 2. a large prompt refused under load


@dataclass
class RefusalRun:
    # Per refusal, in the order sent:
    bodies_mb: list[float]
    expected: list[tuple[int, str]]  # (status, code) a correct server answers
    statuses: list[int]
    codes: list[str | None]
    refusal_s: list[float]
    ready_during_ms: list[float]
    ready_quiet_ms: list[float]
    itl_during_ms: list[float]
    itl_quiet_ms: list[float]
    rss_quiet_mb: float
    rss_growth_each_mb: list[float]  # per refusal: peak during it over the median of the 0.3 s before it
    rss_after_mb: float

    @property
    def ready_p99_ms(self) -> float:
        return _p(self.ready_during_ms, 99)

    @property
    def itl_ratio(self) -> float:
        return _p(self.itl_during_ms, 99) / _p(self.itl_quiet_ms, 99)

    def of_size(self, mb: float) -> list[int]:
        """The indices of the refusals of bodies of `mb` MiB."""
        return [i for i, b in enumerate(self.bodies_mb) if b == mb]

    def rss_ratio_of(self, mb: float) -> float:
        """The largest RSS growth of a refusal of a `mb` MiB body, over its size."""
        growth = [g for g in (self.rss_growth_each_mb[i] for i in self.of_size(mb)) if math.isfinite(g)]
        return max(0.0, *growth) / mb if growth else math.nan

    @property
    def rss_ratio(self) -> float:
        """The largest RSS growth of any refusal over its own body's size."""
        return max(self.rss_ratio_of(mb) for mb in set(self.bodies_mb))

    @property
    def refused(self) -> bool:
        return [(s, c) for s, c in zip(self.statuses, self.codes)] == self.expected

    @property
    def passed(self) -> bool:
        return (
            self.refused
            and self.ready_p99_ms <= READY_P99_TARGET_MS
            and self.itl_ratio <= ITL_RATIO_TARGET
            and self.rss_ratio <= RSS_RATIO_TARGET
        )


_B = TypeVar("_B", bound="_Background")


class _Background:
    """Daemon threads that run from `with` entry until `stop` is set on exit (then joined, at most `join_s` each)."""

    join_s = 30.0

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self: _B) -> _B:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(self.join_s)


class _Streams(_Background):
    """`n` streams generating until `stop`; each chunk's arrival time is kept (the gaps are the inter-token times)."""

    join_s = 60.0

    def __init__(self, base_url: str, body: dict[str, Any], n: int, headers: dict[str, str]) -> None:
        super().__init__()
        self.chunks: list[list[float]] = [[] for _ in range(n)]
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._run, args=(base_url, body, i, headers), daemon=True) for i in range(n)
        ]

    def _run(self, base_url: str, body: dict[str, Any], i: int, headers: dict[str, str]) -> None:
        try:
            with httpx.Client(base_url=base_url, timeout=600, trust_env=False, headers=headers) as http:
                with http.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        self.errors.append(f"stream {i}: HTTP {resp.status_code}: {resp.read()[:300]!r}")
                        return
                    for line in resp.iter_lines():
                        if self.stop.is_set():
                            return  # hang up: the server aborts the rest
                        if line.startswith("data:") and '"text":""' not in line.replace(" ", ""):
                            self.chunks[i].append(time.perf_counter())
        except httpx.HTTPError as exc:
            if not self.stop.is_set():
                self.errors.append(f"stream {i}: {type(exc).__name__}: {exc}")

    def started(self) -> bool:
        return all(self.chunks)

    def gaps(self, windows: list[tuple[float, float]]) -> list[float]:
        """Inter-token gaps (ms) whose interval overlaps one of `windows`."""
        return [(b - a) * 1000 for c in self.chunks for a, b in zip(c, c[1:]) if _overlaps(a, b, windows)]


class _Sampler(_Background):
    """Background samples of /health/ready latency and of the server's RSS."""

    def __init__(self, base_url: str, pid: int | None) -> None:
        super().__init__()
        self.probes: list[tuple[float, float]] = []  # (start, end)
        self.rss: list[tuple[float, float]] = []  # (time, MiB)
        self._threads = [threading.Thread(target=self._probe, args=(base_url,), daemon=True)]
        if pid is not None:
            self._threads.append(threading.Thread(target=self._sample_rss, args=(pid,), daemon=True))

    def _probe(self, base_url: str) -> None:
        with httpx.Client(base_url=base_url, timeout=30, trust_env=False) as http:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                http.get("/health/ready")
                t1 = time.perf_counter()
                self.probes.append((t0, t1))
                time.sleep(max(0.0, _PROBE_INTERVAL_S - (t1 - t0)))

    def _sample_rss(self, pid: int) -> None:
        import psutil

        proc = psutil.Process(pid)
        while not self.stop.is_set():
            self.rss.append((time.perf_counter(), proc.memory_info().rss / 2**20))
            time.sleep(_RSS_INTERVAL_S)

    def latencies(self, windows: list[tuple[float, float]]) -> list[float]:
        return [(b - a) * 1000 for a, b in self.probes if _overlaps(a, b, windows)]

    def rss_in(self, w0: float, w1: float) -> list[float]:
        return [mb for t, mb in self.rss if w0 <= t <= w1]


def _error_code(resp: httpx.Response) -> str | None:
    try:
        return str(resp.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class HostileBody:
    """A body the refusal runs send, and the answer a correct server gives it."""

    data: bytes
    status: int
    code: str

    @property
    def mb(self) -> float:
        return round(len(self.data) / 2**20, 2)


def refusal_run(
    cfg: ServeBenchConfig,
    base_url: str,
    pid: int | None,
    key: str,
    stream_body: dict[str, Any],
    bodies: list[HostileBody],
    say: Progress,
) -> RefusalRun:
    """Streams and probes running; a quiet window; then each body `hostile_refusals` times (in turn), 0.5 s apart."""
    auth = {"Authorization": f"Bearer {key}"}
    sent: list[HostileBody] = [b for _ in range(cfg.hostile_refusals) for b in bodies]
    with _Sampler(base_url, pid) as sampler, _Streams(base_url, stream_body, cfg.hostile_streams, auth) as streams:
        deadline = time.monotonic() + 300
        while not streams.started() and not streams.errors and time.monotonic() < deadline:
            time.sleep(0.05)
        if not streams.started():
            raise RuntimeError(f"the streams did not start: {streams.errors or 'no first token within 300 s'}")
        start = time.perf_counter() + _SETTLE_S
        quiet = (start, start + _QUIET_S)
        time.sleep(_SETTLE_S + _QUIET_S + _QUIET_GUARD_S)
        windows: list[tuple[float, float]] = []
        statuses: list[int] = []
        codes: list[str | None] = []
        headers = {**auth, "Content-Type": "application/json"}
        with httpx.Client(base_url=base_url, timeout=600, trust_env=False) as http:
            for i, body in enumerate(sent):
                t0 = time.perf_counter()
                resp = http.post("/v1/completions", content=body.data, headers=headers)
                t1 = time.perf_counter()
                windows.append((t0, t1))
                statuses.append(resp.status_code)
                codes.append(_error_code(resp))
                say(f"hostile: refusal {i + 1}/{len(sent)} ({body.mb:g} MiB): {resp.status_code} in {t1 - t0:.2f} s")
                time.sleep(0.5)
        after = time.perf_counter()
        time.sleep(1.0)
        if streams.errors:
            raise RuntimeError(f"a stream failed during the refusals: {streams.errors}")
    rss_quiet = sampler.rss_in(*quiet)
    growth = []
    for t0, t1 in windows:
        before, during = sampler.rss_in(t0 - 0.3, t0), sampler.rss_in(t0, t1 + 0.2)
        growth.append(max(during) - statistics.median(before) if before and during else math.nan)
    rss_after = sampler.rss_in(after + 0.5, after + 1.0)
    return RefusalRun(
        bodies_mb=[b.mb for b in sent],
        expected=[(b.status, b.code) for b in sent],
        statuses=statuses,
        codes=codes,
        refusal_s=[b - a for a, b in windows],
        ready_during_ms=sampler.latencies(windows),
        ready_quiet_ms=sampler.latencies([quiet]),
        itl_during_ms=streams.gaps(windows),
        itl_quiet_ms=streams.gaps([quiet]),
        rss_quiet_mb=statistics.median(rss_quiet) if rss_quiet else math.nan,
        rss_growth_each_mb=growth,
        rss_after_mb=statistics.median(rss_after) if rss_after else math.nan,
    )


def hostile_bodies(model: str, prompt_mb: float, max_body_bytes: int) -> list[HostileBody]:
    """The --hostile-prompt-mb prompt; when the server's body limit refuses it from its Content-Length (413), also
    the largest prompt the limit lets through, which is read and refused from its length (400)."""
    bodies = []
    big = request_body_bytes(model, "hello world " * int(prompt_mb * 1e6 / 12))
    over = max_body_bytes and len(big) > max_body_bytes
    bodies.append(
        HostileBody(big, 413, "request_too_large") if over else HostileBody(big, 400, "context_length_exceeded")
    )
    if over:
        fill = request_body_bytes(model, "hello world " * ((max_body_bytes - 256) // 12))
        bodies.append(HostileBody(fill, 400, "context_length_exceeded"))
    return bodies


# ---------------------------------------------------------------- 4. the limits' cost on the normal path


@dataclass
class CostPair:
    """One pair: each server runs the load twice, in the order A B B A (A alternating between pairs), so that a
    load on the machine that drifts over the pair weighs on both alike; throughput is tokens over time of both."""

    with_limits_tps: float
    without_tps: float
    order: str  # which server ran first (and last) in the pair
    failed: int
    errors: dict[str, int]  # failed requests by kind (http_429, timeout, ...), both servers

    @property
    def ratio(self) -> float:
        return self.with_limits_tps / self.without_tps


def _throughput(
    base_url: str,
    path: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    timeout: float,
    headers: dict[str, str] | None,
) -> tuple[float, float, list[str]]:
    """(output tokens/s, wall seconds, the error kind of each failed request) of one closed-loop run."""
    t0 = time.perf_counter()
    results = run_closed(base_url, path, bodies, concurrency, max_duration=600, timeout=timeout, headers=headers)
    wall = time.perf_counter() - t0
    tps = sum(r.output_tokens or 0 for r in results if r.ok) / wall
    return tps, wall, [r.error or "unknown" for r in results if not r.ok]


# ---------------------------------------------------------------- the mode


@dataclass
class HostileResult:
    prompt_mb: float
    streams: int
    refusals_per_run: int
    holds: list[HoldRun]
    refusals: list[RefusalRun]
    corpus: CorpusResult
    pairs: list[CostPair]
    concurrency: int
    requests: int
    timeouts: tuple[float, float]  # the server's body-read and header-read timeouts
    cost: CheckCost
    loads: list[float]  # the machine's 1-minute load average, at the start and after each part

    def median(self, figure: Callable[[RefusalRun], float]) -> float:
        """The median over the runs that have the figure (a run without samples has none); NaN when none has."""
        values = [v for v in (figure(r) for r in self.refusals) if math.isfinite(v)]
        return statistics.median(values) if values else math.nan

    def worst(self, figure: Callable[[RefusalRun], float]) -> float:
        """The largest value over the runs that have the figure (every figure here is a cost); NaN when none has."""
        values = [v for v in (figure(r) for r in self.refusals) if math.isfinite(v)]
        return max(values) if values else math.nan

    @property
    def targets_met(self) -> bool:
        """Every large prompt refused with the right code, and the worst run within each target (the inter-token
        ratio is paired within a run: its during and quiet windows are the same streams of that run). NaN, for no
        samples in any run, meets none."""
        return (
            all(r.refused for r in self.refusals)
            and self.worst(lambda r: r.ready_p99_ms) <= READY_P99_TARGET_MS
            and self.worst(lambda r: r.itl_ratio) <= ITL_RATIO_TARGET
            and self.worst(lambda r: r.rss_ratio) <= RSS_RATIO_TARGET
        )

    @property
    def passed(self) -> bool:
        return self.targets_met and self.corpus.passed

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "prompt_mb": self.prompt_mb,
            "streams": self.streams,
            "refusals_per_run": self.refusals_per_run,
            "holds": [asdict(h) for h in self.holds],
            "refusals": [
                {
                    **asdict(r),
                    "rss_growth_each_mb": [_finite(g) for g in r.rss_growth_each_mb],
                    "ready_p99_ms": _finite(r.ready_p99_ms),
                    "itl_ratio": _finite(r.itl_ratio),
                    "rss_ratio": _finite(r.rss_ratio),
                    "passed": r.passed,
                }
                for r in self.refusals
            ],
            "corpus": self.corpus.as_dict(),
            "pairs": [{**asdict(p), "ratio": p.ratio} for p in self.pairs],
            "concurrency": self.concurrency,
            "requests": self.requests,
            "timeouts": list(self.timeouts),
            "check_cost_us": asdict(self.cost),
            "load_average_1min": self.loads,
        }


@contextmanager
def _server(cfg: ServeBenchConfig, env: dict[str, str], **serve: Any) -> Iterator[tuple[str, int | None]]:
    from .server import StartedServer

    with StartedServer(cfg, env=env, **serve) as srv:
        yield srv.base_url, srv.pid


def run_hostile(cfg: ServeBenchConfig, tokenizer: Any, say: Progress) -> HostileResult:
    from .server import served_model

    if cfg.base_url is not None:
        raise ValueError("--hostile starts its own servers (one with the limits, one without); drop --base-url")
    loads = [os.getloadavg()[0]]
    holds = measure_hold(tokenizer, cfg.hostile_hold_chars, cfg.runs)
    say(f"hostile: tokenizer hold measured ({cfg.runs} runs of {cfg.hostile_hold_chars:,} characters)")
    key = "sk-bench-" + secrets.token_hex(16)
    specs = build_requests(cfg, tokenizer, max(cfg.num_prompts, 2), seed=0)
    cost = measure_check_cost(
        tokenizer, request_body(specs[0], cfg.model, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos)
    )
    timeouts = (
        {}
        if cfg.hostile_timeouts is None
        else {"body_read_timeout": cfg.hostile_timeouts, "header_read_timeout": cfg.hostile_timeouts}
    )
    # The key reaches the server through the environment, never its command line (which `ps` shows).
    with _server(cfg, {_API_KEY_ENV: key}, **timeouts, **_NO_WAIT_LIMIT) as (base_url, pid):
        model = cfg.served_model_name or served_model(base_url, {"Authorization": f"Bearer {key}"})
        from glowplug.lifecycle.config import ServeConfig

        bodies = hostile_bodies(model, cfg.hostile_prompt_mb, ServeConfig().max_body_bytes)
        # As long as the context allows: the streams must outlast a run (they are hung up at its end).
        context = _max_model_len(base_url, key)
        longest = context - cfg.input_len - 16 if context is not None else cfg.hostile_stream_tokens
        stream_body = {
            **request_body(specs[0], model, temperature=cfg.temperature, ignore_eos=True),
            "max_tokens": max(16, min(cfg.hostile_stream_tokens, longest)),
        }
        stream_body.pop("stream_options", None)
        # One untimed refusal of each first: the first large body also pays one-time costs (the worker threads that
        # parse and tokenize, their malloc arenas), which are not what a refusal costs.
        for body in bodies:
            httpx.post(
                base_url + "/v1/completions",
                content=body.data,
                timeout=600,
                trust_env=False,
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
        refusals = []
        for r in range(cfg.runs):
            say(f"hostile: refusal run {r + 1}/{cfg.runs}")
            refusals.append(refusal_run(cfg, base_url, pid, key, stream_body, bodies, say))
            loads.append(os.getloadavg()[0])
        del bodies
        target = _target(cfg, base_url, model, key, cfg.hostile_timeouts, context or 0)
        say(
            f"hostile: corpus ({target.body_read_timeout:g} s body and {target.header_read_timeout:g} s head timeouts"
            " make the slow cases take that long)"
        )
        corpus = run_corpus(target, say)
        loads.append(os.getloadavg()[0])
        bodies = [request_body(s, model, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos) for s in specs]
        path = api_path(cfg.endpoint)
        with _server(cfg, {_API_KEY_ENV: ""}, **_LIMITS_OFF, **_NO_WAIT_LIMIT) as (plain_url, _plain_pid):
            pairs = _cost_pairs(cfg, base_url, plain_url, key, path, bodies, say, loads)
    return HostileResult(
        cfg.hostile_prompt_mb,
        cfg.hostile_streams,
        cfg.hostile_refusals,
        holds,
        refusals,
        corpus,
        pairs,
        cfg.hostile_concurrency,
        len(bodies),
        (target.body_read_timeout, target.header_read_timeout),
        cost,
        loads,
    )


def _max_model_len(base_url: str, key: str) -> int | None:
    resp = httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10, trust_env=False)
    value = resp.json()["data"][0].get("max_model_len")
    return int(value) if value is not None else None


def request_body_bytes(model: str, prompt: str) -> bytes:
    import json

    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 16}).encode()


def _target(
    cfg: ServeBenchConfig, base_url: str, model: str, key: str, timeouts: float | None, max_model_len: int
) -> Target:
    from glowplug.lifecycle.config import ServeConfig

    defaults = ServeConfig()
    port = int(base_url.rsplit(":", 1)[1])
    return Target(
        host="127.0.0.1",
        port=port,
        model=model,
        api_key=key,
        max_body_bytes=defaults.max_body_bytes,
        max_json_depth=defaults.max_json_depth,
        max_json_values=defaults.max_json_values,
        body_read_timeout=timeouts if timeouts is not None else defaults.body_read_timeout,
        header_read_timeout=timeouts if timeouts is not None else defaults.header_read_timeout,
        max_model_len=max_model_len,
        idle_connections=cfg.hostile_idle_connections,
    )


def _cost_pairs(
    cfg: ServeBenchConfig,
    limited: str,
    plain: str,
    key: str,
    path: str,
    bodies: list[dict[str, Any]],
    say: Progress,
    loads: list[float],
) -> list[CostPair]:
    auth = {"Authorization": f"Bearer {key}"}
    conc = cfg.hostile_concurrency
    for url, headers in ((limited, auth), (plain, None)):  # warm-up: first requests compile and fill caches
        _throughput(url, path, bodies[: 2 * conc], conc, cfg.request_timeout, headers)
    pairs = []
    for i in range(cfg.runs):
        first_limited = i % 2 == 0
        a, b = ((limited, auth), (plain, None)) if first_limited else ((plain, None), (limited, auth))
        tokens: dict[str, float] = {limited: 0.0, plain: 0.0}
        seconds: dict[str, float] = {limited: 0.0, plain: 0.0}
        errors: dict[str, int] = {}
        for url, headers in (a, b, b, a):
            tps, wall, bad = _throughput(url, path, bodies, conc, cfg.request_timeout, headers)
            tokens[url] += tps * wall
            seconds[url] += wall
            for kind in bad:
                label = f"{'limits' if url == limited else 'no limits'}: {kind}"
                errors[label] = errors.get(label, 0) + 1
        pair = CostPair(
            tokens[limited] / seconds[limited],
            tokens[plain] / seconds[plain],
            "limits first" if first_limited else "no limits first",
            sum(errors.values()),
            errors,
        )
        say(
            f"hostile: cost pair {i + 1}/{cfg.runs}: {pair.with_limits_tps:.1f} / {pair.without_tps:.1f} tokens/s "
            f"= {pair.ratio:.3f}"
        )
        loads.append(os.getloadavg()[0])
        pairs.append(pair)
    return pairs


# ---------------------------------------------------------------- the report


def render_hostile(r: HostileResult, head: str) -> str:
    from glowplug.profiling.bench.tables import Missing, fmt_num, fmt_spread, markdown_table

    def spread(values: list[float], digits: int = 1) -> str:
        return fmt_spread(values, digits)

    ref = r.refusals
    sizes = sorted(set(ref[0].bodies_mb), reverse=True)

    def row(label: str, values: list[float], target: str = "—", digits: int = 1) -> list[Any]:
        # The worst run is the largest value: every figure here is a cost (time, latency, ratio, memory).
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            return [label, Missing("no samples"), target, Missing("no samples")]
        return [label, spread(finite, digits), target, fmt_num(max(finite), digits)]

    pooled_during = [g for x in ref for g in x.itl_during_ms]
    pooled_quiet = [g for x in ref for g in x.itl_quiet_ms]

    rows: list[list[Any]] = []
    for mb in sizes:
        got = sorted({f"{x.statuses[i]} {x.codes[i]}" for x in ref for i in x.of_size(mb)})
        want = next(f"{s} {c}" for x in ref[:1] for i in x.of_size(mb) for s, c in [x.expected[i]])
        rows += [
            [f"{mb:g} MiB body: status and code of every refusal", ", ".join(got), want, "—"],
            row(
                f"{mb:g} MiB body: time to refusal, median per run (s)",
                [statistics.median(x.refusal_s[i] for i in x.of_size(mb)) for x in ref],
                digits=2,
            ),
            row(
                f"{mb:g} MiB body: RSS growth / body size",
                [x.rss_ratio_of(mb) for x in ref],
                f"<= {RSS_RATIO_TARGET:g}",
                2,
            ),
        ]
    rows += [
        row("/health/ready p99 during refusals (ms)", [x.ready_p99_ms for x in ref], f"<= {READY_P99_TARGET_MS:g}"),
        row("/health/ready p99 in the quiet window (ms)", [_p(x.ready_quiet_ms, 99) for x in ref]),
        row("Inter-token p99 during refusals (ms)", [_p(x.itl_during_ms, 99) for x in ref]),
        row("Inter-token p99 in the quiet window (ms)", [_p(x.itl_quiet_ms, 99) for x in ref]),
        row("Inter-token p99, during / quiet", [x.itl_ratio for x in ref], f"<= {ITL_RATIO_TARGET:g}", 2),
        row(
            "Inter-token p99, during / quiet, all runs' gaps pooled",
            [_p(pooled_during, 99) / _p(pooled_quiet, 99)],
            f"<= {ITL_RATIO_TARGET:g}",
            2,
        ),
        row("RSS 0.5-1 s after the last refusal, over quiet (MiB)", [x.rss_after_mb - x.rss_quiet_mb for x in ref]),
        ["Probes during refusals (count)", spread([float(len(x.ready_during_ms)) for x in ref], 0), "—", "—"],
        ["Inter-token gaps during refusals (count)", spread([float(len(x.itl_during_ms)) for x in ref], 0), "—", "—"],
    ]
    hold_rows = [
        [
            "`encode` (whole text, GIL held)",
            spread([h.whole_s * 1000 for h in r.holds]),
            spread([h.whole_late_ms for h in r.holds]),
        ],
        [
            "`encode_bounded` (pieces, GIL released)",
            spread([h.bounded_s * 1000 for h in r.holds]),
            spread([h.bounded_late_ms for h in r.holds]),
        ],
    ]
    groups: dict[str, list[Any]] = {}
    for c in r.corpus.cases:
        groups.setdefault(c.group, []).append(c)
    corpus_rows = []
    for group, cases in groups.items():
        outcomes: dict[str, int] = {}
        for c in cases:
            o = c.outcome
            key = (
                str(o.status) if o.status is not None else ("clean close" if o.closed else "reset" if o.reset else "?")
            )
            outcomes[key] = outcomes.get(key, 0) + 1
        corpus_rows.append(
            [
                group,
                len(cases),
                ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())),
                sum(1 for c in cases if c.outcome.status is not None and c.outcome.status >= 500),
                sum(1 for c in cases if c.ready_after and c.normal_after),
                sum(1 for c in cases if c.passed),
            ]
        )
    ratios = [p.ratio for p in r.pairs]
    worst = min(r.pairs, key=lambda p: p.ratio) if r.pairs else None
    pair_rows = [
        [
            i + 1,
            p.order,
            fmt_num(p.with_limits_tps, 1),
            fmt_num(p.without_tps, 1),
            fmt_num(p.ratio, 3),
            ", ".join(f"{k} {v}" for k, v in sorted(p.errors.items())) or "0",
        ]
        for i, p in enumerate(r.pairs)
    ]
    failed_cases = [c for c in r.corpus.cases if not c.passed]
    verdict = "PASS" if r.passed else "FAIL"
    from glowplug.lifecycle.config import ServeConfig

    defaults = ServeConfig()
    bodies = " and ".join(f"{mb:g} MiB" for mb in sizes)
    parts = [
        head,
        f"- **verdict: {verdict}**, against: every large prompt refused with the right 4xx, the worst run "
        "within each target (the Worst run column), every corpus case a 4xx or a clean close with the server "
        "READY and a normal request "
        f"succeeding after it. Runs within every target: {sum(1 for x in r.refusals if x.passed)}/"
        f"{len(r.refusals)}. Figures: median over runs (min–max), and the worst run",
        "",
        "## A large prompt refused under load",
        "",
        f'- /v1/completions bodies of {bodies} (`"hello world " * n`: the {r.prompt_mb:g} MB prompt, and, when '
        "the body limit refuses that from its Content-Length, the largest prompt the limit lets through, which is "
        f"read and refused from its length), each sent {r.refusals_per_run} times per run, in turn, while "
        f"{r.streams} streams generate; server: default limits (`--max-body-bytes` {defaults.max_body_bytes:,}, "
        f"`--max-json-depth` {defaults.max_json_depth}, `--max-json-values` {defaults.max_json_values:,}, "
        f"`--body-read-timeout` {r.timeouts[0]:g} s, `--header-read-timeout` {r.timeouts[1]:g} s) and an API key; "
        f"both servers of this report run with `--max-queue-wait {_NO_WAIT_LIMIT['max_queue_wait']:g}` (admission, "
        "not a transport limit: on a loaded machine its 429s would fall on one run of a pair and not the other)",
        "- during refusals: probes and inter-token gaps whose interval overlaps a refusal (send to response); quiet: "
        f"the same streams over {_QUIET_S:g} s, from {_SETTLE_S:g} s after every stream's first token (a run's first "
        f"steps are not quiet: one took 0.42 s) to {_QUIET_GUARD_S:g} s before the first refusal (so that no gap "
        "counts as both); RSS sampled every "
        f"{_RSS_INTERVAL_S * 1000:g} ms, growth = a refusal's peak over the median of the 0.3 s before it; one "
        "untimed refusal of each body before the runs (the first large body also pays for the worker threads and "
        "their malloc arenas)",
        "",
        markdown_table(["", "Median (min–max)", "Target", "Worst run"], rows),
        "",
        "## The tokenizer's hold on other threads",
        "",
        f'- {r.holds[0].chars:,} characters of `"hello world "`, tokenized in this process while a 10 ms timer runs '
        "on another thread; the timer's worst lateness is how long the tokenizer kept every other thread "
        "(the event loop, the engine loop) from running",
        "",
        markdown_table(["", "Time (ms)", "Worst timer lateness (ms)"], hold_rows),
        "",
        "## The hostile corpus",
        "",
        f"- {len(r.corpus.cases)} cases (profiling/bench/serve/hostile_corpus.py; the same corpus as "
        "tests/lifecycle/test_hostile.py) against the server above, real sockets; after each case /health/ready "
        "and a normal completion",
        f"- **responses 5xx: {r.corpus.server_errors}**; cases passed: "
        f"{sum(1 for c in r.corpus.cases if c.passed)}/{len(r.corpus.cases)}",
        "",
        markdown_table(["Group", "Cases", "Outcomes", "5xx", "Healthy after", "Passed"], corpus_rows),
        "",
    ]
    if failed_cases:
        parts += ["Failed cases:", ""] + [f"- {c.name}: expected {c.expected}, got {c.outcome}" for c in failed_cases]
        parts.append("")
    parts += [
        "## The limits' cost on the normal path",
        "",
        f"- {r.requests} streaming completions at concurrency {r.concurrency}, closed loop, on the server above "
        "(limits and key) and on one with the limits off (no key, `--max-body-bytes 0 --body-read-timeout 0 "
        "--header-read-timeout 0`), both running; each pair runs the load four times, A B B A, A alternating "
        "between pairs, and divides the tokens/s of the server with limits by the other's",
    ]
    if ratios and worst is not None:
        parts.append(f"- **throughput with / without limits: {fmt_spread(ratios, 3)}**, worst pair {worst.ratio:.3f}")
    parts.append(
        f"- the machine's 1-minute load average over this run: {min(r.loads):.1f}–{max(r.loads):.1f} on "
        f"{os.cpu_count()} cores (other work shared it: the spread of the pairs is that noise)"
    )
    parts += [
        "",
        markdown_table(
            ["Pair", "Order", "With limits (tokens/s)", "Without (tokens/s)", "Ratio", "Failed requests"], pair_rows
        ),
        "",
    ]
    c = r.cost
    cost_rows = [
        [
            "Read, scan (depth, elements), strict UTF-8, parse, Unicode check, validate",
            fmt_num(c.parse_us, 1),
            fmt_num(c.parse_plain_us, 1),
            fmt_num(c.parse_us - c.parse_plain_us, 1),
        ],
        ["API key (SHA-256, compare_digest)", fmt_num(c.key_us, 1), "0", fmt_num(c.key_us, 1)],
        [
            "Tokenize: `encode_bounded` against `encode`",
            fmt_num(c.tokenize_us, 1),
            fmt_num(c.tokenize_plain_us, 1),
            fmt_num(c.tokenize_us - c.tokenize_plain_us, 1),
        ],
    ]
    parts += [
        f"What the checks cost one normal request, measured in this process, where no machine noise hides it (a "
        f"{c.body_bytes:,}-byte body of this run's requests; microseconds per request, median of 5 rounds):",
        "",
        markdown_table(["Step", "With the checks (us)", "Before (us)", "Added (us)"], cost_rows),
        "",
    ]
    return "\n".join(parts)


def hostile_mode(
    cfg: ServeBenchConfig, tokenizer: Any, argv: list[str] | None, say: Progress, server_for: Any
) -> tuple[bool, list[Path]]:
    """The hostile mode (`server_for` is unused: each measurement starts its own server with its own limits)."""
    from glowplug.profiling.bench.cli_support import prepare_out_dir
    from glowplug.profiling.bench.machine import report_header

    from .report import write_mode_report

    out = prepare_out_dir(cfg.out_dir)
    result = run_hostile(cfg, tokenizer, say)
    text = render_hostile(result, report_header("Hostile input at the transport", argv))
    return result.passed, write_mode_report(cfg, out, "hostile", text, result.as_dict())
