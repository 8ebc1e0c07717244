"""One streamed request against an OpenAI-compatible server (httpx, async), timed from the client's side.

TTFT: request sent -> first chunk that carries output (text, or logprobs of a token). ITL: the gaps between such
chunks. E2E: sent -> `data: [DONE]`. Output tokens: the `usage` of the last chunk (stream_options.include_usage);
when the request asked for logprobs, the tokens the stream itself carried are counted too, so a stream can be
checked against its usage. Every failure is classified by type (http_429, connect, timeout, stream_error, ...).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from .workload import RequestSpec


@dataclass
class RequestResult:
    index: int
    sent_at: float  # perf_counter when the request went out
    ok: bool = False
    error: str | None = None  # the failure type (see classify), None when ok
    detail: str | None = None
    status: int | None = None
    retry_after: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None  # from usage
    streamed_tokens: int = 0  # tokens the stream carried logprobs for (exact when logprobs were asked for)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    done_marker: bool = False
    hung_up: bool = False  # the client left on purpose mid-stream

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(spec: RequestSpec, model: str | None, *, temperature: float, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": spec.output_len,
        "temperature": temperature,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    body.update(spec.extra)
    return body


def _count_tokens(choice: dict[str, Any]) -> int:
    lp = choice.get("logprobs")
    if not lp:
        return 0
    if "tokens" in lp:  # completions
        return len(lp["tokens"])
    return len(lp.get("content") or [])  # chat


def _has_output(choice: dict[str, Any]) -> bool:
    if choice.get("text") or choice.get("logprobs"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content"))


def classify(exc: BaseException) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "protocol"
    if isinstance(exc, httpx.ReadError):
        return "read"
    if isinstance(exc, json.JSONDecodeError):
        return "bad_json"
    return type(exc).__name__


def _on_chunk(result: RequestResult, data: dict[str, Any], now: float, last: list[float]) -> None:
    if "error" in data and "choices" not in data:
        result.error = "stream_error"
        result.detail = str(data["error"].get("message"))[:300]
        return
    usage = data.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens")
    for choice in data.get("choices") or ():
        result.streamed_tokens += _count_tokens(choice)
        if choice.get("finish_reason"):
            result.finish_reasons[int(choice.get("index", 0))] = choice["finish_reason"]
        if _has_output(choice):
            if result.ttft_s is None:
                result.ttft_s = now - result.sent_at
            elif last:
                result.itl_s.append(now - last[0])
            last[:] = [now]


async def send_streaming(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    index: int,
    *,
    hangup_after_chunks: int | None = None,
) -> RequestResult:
    """POST `body` to `path` with stream=true and read the SSE stream to its end (or hang up after N chunks)."""
    result = RequestResult(index=index, sent_at=time.perf_counter())
    last: list[float] = []
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                result.error = f"http_{resp.status_code}"
                result.retry_after = resp.headers.get("retry-after")
                try:
                    result.detail = str(resp.json()["error"]["message"])[:300]
                except (ValueError, KeyError, TypeError):
                    result.detail = resp.text[:300]
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                payload = line[5:].strip()
                if payload == "[DONE]":
                    result.done_marker = True
                    result.e2e_s = now - result.sent_at
                    continue
                _on_chunk(result, json.loads(payload), now, last)
                chunks += 1
                if hangup_after_chunks is not None and chunks >= hangup_after_chunks:
                    result.hung_up = True
                    result.e2e_s = now - result.sent_at
                    return result  # leaving the `async with` closes the connection mid-stream
    except Exception as exc:
        result.error = classify(exc)
        result.detail = f"{type(exc).__name__}: {exc}"[:300]
        return result
    if result.error is None and not result.done_marker:
        result.error = "incomplete"
    if result.error is None and result.output_tokens is None:
        result.error = "no_usage"
    result.ok = result.error is None
    return result


def make_client(
    base_url: str, connections: int, timeout: float, headers: dict[str, str] | None = None
) -> httpx.AsyncClient:
    """An async client sized for `connections` concurrent streams (no proxies: the traffic is local); `headers` go
    on every request (an API key)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(timeout, connect=30.0),
        limits=limits,
        trust_env=False,
        headers=headers,
    )
