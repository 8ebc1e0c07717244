"""The service's Prometheus metrics, on a registry of its own so that two services in one process (tests) or a
library user's own metrics never collide.

Names follow vLLM's where one exists (with the `glowplug_` prefix), so existing dashboards need a rename only.
prometheus_client metrics are thread-safe. The engine gauges, token counters and step times come from the engine
core's per-step frames (lifecycle/core_client.py); the process metrics are the server's (`process_*`) and the
core process's (`glowplug_engine_core_process_*`).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from glowplug.profiling.names import STARTUP_PREDICTED_METRIC, Metric

from .live_metrics import RecentRequests
from .state import EngineState


class RejectReason:
    """`reason` labels of glowplug_request_rejected set by the transport checks (transport.py, protocol.py)."""

    UNAUTHORIZED = "unauthorized"
    HEAD_TOO_LARGE = "head_too_large"
    BODY_TOO_LARGE = "body_too_large"
    BODY_TIMEOUT = "body_timeout"
    JSON_TOO_DEEP = "json_too_deep"
    TOO_MANY_VALUES = "too_many_values"
    INVALID_UNICODE = "invalid_unicode"
    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"


class DisconnectStage:
    """`stage` labels of glowplug_client_disconnects: what the server was doing when the client left."""

    BODY = "body"  # reading the request body
    WAITING = "waiting"  # waiting for READY or for admission, before generation began
    RESPONSE = "response"  # generating: collecting a non-streamed answer or sending a stream


# Latency buckets from 1 ms to 5 min: tiny CPU models answer in milliseconds, big ones on a CPU in minutes.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            Metric.TTFT,
            "Request received -> first output token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            Metric.TPOT,
            "Mean time between output tokens after the first, per request.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            Metric.E2E_LATENCY,
            "Request received -> last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            Metric.QUEUE_TIME,
            "Request received -> first scheduled in the engine (includes waiting for READY).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_step = Histogram(
            Metric.ENGINE_STEP,
            "Wall time of one engine step (schedule, forward, sample, book) in the engine core.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(Metric.REQUESTS_RUNNING, "Requests with sequences in the engine batch.", registry=r)
        self.waiting = Gauge(
            Metric.REQUESTS_WAITING, "Requests admitted and not yet running (admission queue).", registry=r
        )
        self.prompt_cost = Gauge(
            Metric.PROMPT_COST,
            "Admission's fit of a step's prompt part: seconds = fixed + per_token * tokens (0 until fitted).",
            ["part"],
            registry=r,
        )
        self.waiting_prompt_tokens = Gauge(
            Metric.PROMPT_TOKENS_WAITING,
            "Prompt tokens of the admitted requests not yet running (what admission's expected wait counts).",
            registry=r,
        )
        self.kv_usage = Gauge(Metric.KV_USAGE, "Fraction of KV-cache blocks in use (0..1).", registry=r)
        self.kv_used_blocks = Gauge(Metric.KV_USED_BLOCKS, "KV-cache blocks in use.", registry=r)
        self.kv_total_blocks = Gauge(Metric.KV_TOTAL_BLOCKS, "KV-cache blocks in all.", registry=r)
        self.prompt_tokens = Counter(Metric.PROMPT_TOKENS, "Prompt tokens admitted to the engine.", registry=r)
        self.generation_tokens = Counter(Metric.GENERATION_TOKENS, "Tokens generated.", registry=r)
        self.completed_generation_tokens = Counter(
            Metric.COMPLETED_GENERATION_TOKENS,
            "Tokens of requests that ended with stop or length once the server had read their end: together with the "
            "aborted tokens, every generated token. A client may still hang up before the last bytes reach it.",
            registry=r,
        )
        self.aborted_generation_tokens = Counter(
            Metric.ABORTED_GENERATION_TOKENS,
            "Tokens generated for requests whose client was gone before their end arrived (hung up, drained), "
            "whether the engine aborted them or had just finished them: work nobody received.",
            registry=r,
        )
        # process_resident_memory_bytes, CPU seconds, open fds: what a soak watches for leaks (Linux only;
        # elsewhere the collector exports nothing).
        ProcessCollector(registry=r)
        self.core_pid: int | None = None  # the engine core's process (None: none, or a core thread)
        ProcessCollector(namespace=Metric.ENGINE_CORE, pid=lambda: self.core_pid or "none", registry=r)
        self.core_restarts = Counter(
            Metric.ENGINE_CORE_RESTARTS, "Engine cores started again after one died (--restart-core).", registry=r
        )
        self.finished = Counter(
            Metric.REQUEST_FINISHED,
            "Requests finished, by finish reason (stop, length, abort, error).",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            Metric.REQUEST_REJECTED,
            "Requests turned away before generation, by reason.",
            ["reason"],
            registry=r,
        )
        self.client_disconnects = Counter(
            Metric.CLIENT_DISCONNECTS,
            "Clients that disconnected before their response was complete, by what the server was doing (body, "
            "waiting, response). A client's fault, never a server error.",
            ["stage"],
            registry=r,
        )
        self.connections_timed_out = Counter(
            Metric.CONNECTIONS_TIMED_OUT,
            "Connections closed because no complete request head arrived within --header-read-timeout.",
            registry=r,
        )
        self.phase_duration = Gauge(
            Metric.STARTUP_PHASE_DURATION,
            "Duration of each finished start-up phase of this process.",
            ["phase"],
            registry=r,
        )
        self.startup_predicted = Gauge(
            STARTUP_PREDICTED_METRIC,
            "Predicted time to READY, seconds from process creation: prediction=first is the first one made (before "
            "the engine import when the start-up profile allows), prediction=latest the current one while starting "
            "(it follows the stages as they finish or overrun) and the actual time once READY.",
            ["prediction"],
            registry=r,
        )
        self.state = Enum(
            Metric.ENGINE_STATE, "The engine's life-cycle state.", states=[s.value for s in EngineState], registry=r
        )
        self.state.state(EngineState.STARTING.value)
        # Exact latency percentiles of the last minute for the live page (the histograms above keep buckets only).
        self.recent = RecentRequests()

    def set_state(self, state: EngineState) -> None:
        self.state.state(state.value)

    def set_phase_durations(self, seconds: Mapping[str, float]) -> None:
        for phase, value in seconds.items():
            self.phase_duration.labels(phase=phase).set(value)

    def set_startup_predicted(self, *, first: float | None = None, latest: float | None = None) -> None:
        if first is not None:
            self.startup_predicted.labels(prediction="first").set(first)
        if latest is not None:
            self.startup_predicted.labels(prediction="latest").set(latest)

    def set_prompt_cost(self, fixed_s: float, token_s: float) -> None:
        self.prompt_cost.labels(part="fixed").set(fixed_s)
        self.prompt_cost.labels(part="per_token").set(token_s)

    def set_engine_gauges(self, *, running: int, used_blocks: int, total_blocks: int) -> None:
        self.running.set(running)
        self.kv_used_blocks.set(used_blocks)
        self.kv_total_blocks.set(total_blocks)
        self.kv_usage.set(used_blocks / total_blocks if total_blocks else 0.0)

    def observe_request(
        self,
        *,
        finish_reason: str,
        queue_s: float | None,
        ttft_s: float | None,
        e2e_s: float | None,
        tpot_s: float | None,
    ) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()
        self.recent.add(ttft_s, tpot_s)
        for hist, value in ((self.queue_time, queue_s), (self.ttft, ttft_s), (self.e2e, e2e_s), (self.tpot, tpot_s)):
            if value is not None and value >= 0.0:
                hist.observe(value)

    def current(self) -> dict[str, float]:
        """The engine gauges and token counters as /metrics would show them now."""
        return {
            "running": _value(self.running),
            "waiting": _value(self.waiting),
            "kv_usage": _value(self.kv_usage),
            "kv_used_blocks": _value(self.kv_used_blocks),
            "kv_total_blocks": _value(self.kv_total_blocks),
            "generation_tokens": _value(self.generation_tokens),
            "prompt_tokens": _value(self.prompt_tokens),
        }

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _value(metric: Gauge | Counter) -> float:
    """The value of an unlabelled gauge or counter, through the public collect() API."""
    family = next(iter(metric.collect()))
    wanted = family.name + "_total" if family.type == "counter" else family.name
    return next((s.value for s in family.samples if s.name == wanted), 0.0)
