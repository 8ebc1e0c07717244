"""Span files: OTLP/JSON (what collectors and `otel-desktop-viewer`-style tools read) and Chrome trace events
(chrome://tracing, https://ui.perfetto.dev).

OTLP/JSON follows the OTLP file format: one `ExportTraceServiceRequest` per line, protobuf's JSON mapping with
lowerCamelCase keys and integer enums, except that trace and span ids are hex strings instead of the mapping's
base64 (the OTLP spec requires hex). The request itself comes from the same encoder the OTLP exporters use, so a
file and a live export carry identical data.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import format_span_id, format_trace_id

from glowplug.profiling.names import STARTUP_SPAN, Attr

_ID_KEYS: Final = frozenset({"traceId", "spanId", "parentSpanId"})


def _convert_ids(node: Any, convert: Callable[[str], str]) -> Any:
    if isinstance(node, dict):
        return {
            k: convert(v) if k in _ID_KEYS and isinstance(v, str) else _convert_ids(v, convert) for k, v in node.items()
        }
    if isinstance(node, list):
        return [_convert_ids(v, convert) for v in node]
    return node


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_b64(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode("ascii")


def otlp_json_line(spans: Sequence[ReadableSpan]) -> str:
    """One OTLP/JSON line (no newline) holding `spans`."""
    data = json_format.MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    return json.dumps(_convert_ids(data, _b64_to_hex), separators=(",", ":"))


def write_otlp_json(spans: Sequence[ReadableSpan], path: str | Path) -> Path:
    """Write `spans` as an OTLP/JSON file (JSON Lines, one request)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(otlp_json_line(spans) + "\n", encoding="utf-8")
    return path


def read_otlp_json(path: str | Path) -> list[ExportTraceServiceRequest]:
    """Parse an OTLP/JSON file back into protobuf requests (one per non-empty line)."""
    requests = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            data = _convert_ids(json.loads(line), _hex_to_b64)
            requests.append(json_format.ParseDict(data, ExportTraceServiceRequest()))
    return requests


# ---------------------------------------------------------------- Chrome trace events


def _lanes(spans: Sequence[ReadableSpan]) -> list[int]:
    """A thread lane per span such that spans in one lane are either nested or disjoint.

    Chrome and Perfetto draw "X" events of one tid as a flame chart, which is only right when they nest; the
    start-up is one nested tree, but concurrent request spans overlap and need lanes of their own.
    """
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start_time or 0, -(spans[i].end_time or 0)))
    stacks: list[list[int]] = []
    lane_of = [0] * len(spans)
    for i in order:
        start, end = spans[i].start_time or 0, spans[i].end_time or 0
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or stack[-1] >= end:
                stack.append(end)
                lane_of[i] = lane
                break
        else:
            stacks.append([end])
            lane_of[i] = len(stacks) - 1
    return lane_of


def _thread(span: ReadableSpan) -> str | None:
    value = (span.attributes or {}).get(Attr.THREAD_NAME)
    return None if value is None else str(value)


def _thread_lanes(spans: Sequence[ReadableSpan]) -> tuple[list[int], dict[int, str]]:
    """Lanes where spans that say which thread ran them (start-up stages run concurrently) get one lane per
    thread, named after it; the thread of the start-up span shares its lane (its stages nest inside it). Every
    other span goes through `_lanes`."""
    main = {t for s in spans if s.name == STARTUP_SPAN and (t := _thread(s)) is not None}
    plain = [i for i, s in enumerate(spans) if _thread(s) is None or s.name == STARTUP_SPAN or _thread(s) in main]
    lane_of = [0] * len(spans)
    for i, lane in zip(plain, _lanes([spans[i] for i in plain]), strict=True):
        lane_of[i] = lane
    names: dict[int, str] = {}  # the start-up span's own lane keeps its name, "startup"
    next_lane = max((lane_of[i] for i in plain), default=-1) + 1
    own: dict[str, int] = {}
    for i, span in enumerate(spans):
        thread = _thread(span)
        if i in plain or thread is None:
            continue
        if thread not in own:
            own[thread] = next_lane
            names[next_lane] = thread
            next_lane += 1
        lane_of[i] = own[thread]
    return lane_of, names


def _args(span: ReadableSpan) -> dict[str, Any]:
    args: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()}
    ctx = span.context
    if ctx is not None:
        args["trace_id"] = format_trace_id(ctx.trace_id)
        args["span_id"] = format_span_id(ctx.span_id)
    if span.parent is not None:
        args["parent_span_id"] = format_span_id(span.parent.span_id)
    args["status"] = span.status.status_code.name
    if span.status.description:
        args["status_description"] = span.status.description
    return args


def chrome_trace(spans: Iterable[ReadableSpan]) -> dict[str, Any]:
    """The trace-event JSON object for `spans`: ts/dur in µs from the earliest span, one pid per service."""
    finished = [s for s in spans if s.start_time is not None and s.end_time is not None]
    origin = min((s.start_time or 0 for s in finished), default=0)
    services: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    # Tensor parallelism: each rank's spans are a process of their own in the viewer (one group of lanes per
    # rank), laid out on their own; without ranks this is one group, as before.
    by_rank: dict[Any, list[ReadableSpan]] = {}
    for span in finished:
        by_rank.setdefault((span.attributes or {}).get(Attr.RANK), []).append(span)
    placed: list[tuple[ReadableSpan, int, dict[int, str]]] = []
    for group in by_rank.values():
        lanes, thread_names = _thread_lanes(group)
        placed += [(span, lane, thread_names) for span, lane in zip(group, lanes, strict=True)]
    lane_names: dict[tuple[int, int], str] = {}
    for span, lane, thread_names in placed:
        service = str(span.resource.attributes.get("service.name", "unknown"))
        rank = (span.attributes or {}).get(Attr.RANK)
        if rank is not None:
            service = f"{service} rank {rank}"
        pid = services.setdefault(service, len(services) + 1)
        default = "startup" if span.name.startswith(STARTUP_SPAN) else span.name
        lane_names.setdefault((pid, lane), thread_names.get(lane, default))
        events.append(
            {
                "name": span.name,
                "cat": "startup" if span.name.startswith(STARTUP_SPAN) else "span",
                "ph": "X",
                "ts": ((span.start_time or 0) - origin) / 1e3,
                "dur": ((span.end_time or 0) - (span.start_time or 0)) / 1e3,
                "pid": pid,
                "tid": lane,
                "args": _args(span),
            }
        )
        for event in span.events:
            events.append(
                {
                    "name": event.name,
                    "ph": "i",
                    "s": "t",
                    "ts": (event.timestamp - origin) / 1e3,
                    "pid": pid,
                    "tid": lane,
                    "args": {k: list(v) if isinstance(v, tuple) else v for k, v in (event.attributes or {}).items()},
                }
            )
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": service}}
        for service, pid in services.items()
    ]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": lane, "args": {"name": name}}
        for (pid, lane), name in lane_names.items()
    ]
    # Parents before children at equal timestamps: trace viewers nest "X" events in file order on ties.
    events.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"origin_unix_ns": origin, "source": "glowplug"},
    }


def write_chrome_trace(spans: Iterable[ReadableSpan], path: str | Path) -> Path:
    """Write a Chrome trace-event file that chrome://tracing and Perfetto open."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans)), encoding="utf-8")
    return path
