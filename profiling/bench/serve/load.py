"""Driving load: closed loop (N clients, each sends its next request when the last one ends) and open loop (requests
sent at scheduled times whatever the server does). Both are bounded twice: by the request list and by a deadline
after which nothing new is sent (requests in flight then get `request_timeout` to end).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from .client import RequestResult, make_client, send_streaming

Progress = Callable[[str], None]


def api_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


async def closed_loop(
    client: httpx.AsyncClient,
    path: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    max_duration: float,
    hangups: dict[int, int] | None = None,
) -> list[RequestResult]:
    """`concurrency` clients work through `bodies` in order; stops handing out new ones after `max_duration`."""
    deadline = time.monotonic() + max_duration
    next_index = 0
    results: list[RequestResult] = []

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(bodies) and time.monotonic() < deadline:
            i = next_index
            next_index += 1
            hang = hangups.get(i) if hangups else None
            results.append(await send_streaming(client, path, bodies[i], i, hangup_after_chunks=hang))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    return sorted(results, key=lambda r: r.index)


async def open_loop(
    client: httpx.AsyncClient,
    path: str,
    bodies: Sequence[dict[str, Any]],
    offsets: Sequence[float],
    max_duration: float,
) -> list[RequestResult]:
    """Send body i at `offsets[i]` seconds from now (none after `max_duration`); wait for all to end."""
    start = time.monotonic()
    tasks: list[asyncio.Task[RequestResult]] = []
    for i, (body, at) in enumerate(zip(bodies, offsets, strict=True)):
        if at > max_duration:
            break
        delay = start + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(send_streaming(client, path, body, i)))
    return list(await asyncio.gather(*tasks))


def run_closed(
    base_url: str,
    path: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    *,
    max_duration: float,
    timeout: float,
    hangups: dict[int, int] | None = None,
    headers: dict[str, str] | None = None,
) -> list[RequestResult]:
    async def go() -> list[RequestResult]:
        async with make_client(base_url, concurrency, timeout, headers) as client:
            return await closed_loop(client, path, bodies, concurrency, max_duration, hangups)

    return asyncio.run(go())


def run_open(
    base_url: str,
    path: str,
    bodies: Sequence[dict[str, Any]],
    offsets: Sequence[float],
    *,
    max_duration: float,
    timeout: float,
) -> list[RequestResult]:
    async def go() -> list[RequestResult]:
        # One connection per request in flight: a pool that makes a request wait would shift its send time.
        async with make_client(base_url, max(1, len(bodies)), timeout) as client:
            return await open_loop(client, path, bodies, offsets, max_duration)

    return asyncio.run(go())
