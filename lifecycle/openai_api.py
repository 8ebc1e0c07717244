"""`/v1/models`, `/v1/completions`, `/v1/chat/completions`: OpenAI-compatible, streamed (SSE) or not.

One request's path: parse and shape-check the body, validate its SamplingParams (400s come before anything
waits), take admission slots (429), wait for READY (503 after `ready_wait`), tokenize and check lengths, hand
the prompts to the engine loop, then stream or collect. A client that goes away at any point aborts its engine
requests; `Generation.close()` in the response's `finally` makes that hold even for cancelled handlers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from starlette.types import Receive, Scope, Send

from glowplug.engine.models.arch import ModelError
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.tokenizer import encode_chat

from .engine_loop import Ended
from .errors import ApiError, bad_request
from .generation import Generation, PromptEvent
from .observe import RequestTrace, access_fields, request_id
from .protocol import ChatCompletionRequest, CompletionRequest, parse_body
from .responses import (
    SSE_DONE,
    Choice,
    Kind,
    ResponseHeader,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    sse,
)
from .service import EngineInfo, Rejected, Service

if TYPE_CHECKING:
    from glowplug.engine.llm_engine import RequestOutput

T = TypeVar("T")

_REJECTION_TYPES = {429: "rate_limit_error", 503: "service_unavailable"}


class ClientGone(Exception):
    """The client disconnected while the server was still working on its request."""


class GenerationStream(StreamingResponse):
    """A streaming response that closes its Generation however the stream ends (done, error, disconnect)."""

    def __init__(self, content: AsyncIterator[bytes], generation: Generation) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.close()


async def _wait_disconnect(request: Request) -> None:
    # After the body is read, the server's receive() only returns when the client leaves (or the response is done).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but raise ClientGone (cancelling it) as soon as the client disconnects."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch):
            if not task.done():
                task.cancel()
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    raise ClientGone()


def _rejected(r: Rejected) -> ApiError:
    headers = {"Retry-After": str(r.retry_after)} if r.retry_after is not None else None
    kind = _REJECTION_TYPES.get(r.status, "server_error")
    return ApiError(r.status, r.message, type=kind, code=r.reason, headers=headers)


def _check_model(service: Service, model: str | None) -> None:
    """404 `model_not_found` for a model this server does not serve (OpenAI's and vLLM's answer); none = ours."""
    if model is not None and model != service.model_name:
        raise ApiError(
            404,
            f"the model `{model}` does not exist on this server; it serves `{service.model_name}` (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def _check_prompt(info: EngineInfo, tokens: list[int], params: SamplingParams, param: str) -> None:
    try:
        info.validate_request(tokens, params)
    except ValueError as exc:
        code = "context_length_exceeded" if "max-model-len" in str(exc) else None
        raise bad_request(f"{param}: {exc}", param, code=code) from None


def _completion_prompts(info: EngineInfo, req: CompletionRequest, params: SamplingParams) -> list[list[int]]:
    p = req.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        raw = [list(p)]  # type: ignore[arg-type]
    else:
        raw = list(p)  # type: ignore[arg-type]
    prompts = []
    for i, item in enumerate(raw):
        tokens = list(info.tokenizer(item)["input_ids"]) if isinstance(item, str) else list(item)
        _check_prompt(info, tokens, params, "prompt" if len(raw) == 1 else f"prompt[{i}]")
        prompts.append(tokens)
    return prompts


def _chat_prompt(info: EngineInfo, req: ChatCompletionRequest) -> tuple[list[list[int]], SamplingParams]:
    try:
        tokens = encode_chat(info.tokenizer, req.message_dicts())
    except ModelError as exc:
        raise bad_request(str(exc), "messages") from None
    left = info.max_model_len - len(tokens)
    if req.requested_max_tokens is None and left < 1:
        raise bad_request(
            f"the messages take {len(tokens)} tokens, the whole max-model-len ({info.max_model_len}); shorten them",
            "messages",
            code="context_length_exceeded",
        )
    params = req.sampling_params(max_tokens=left)
    _check_prompt(info, tokens, params, "messages")
    return [tokens], params


def _num_prompts(req: CompletionRequest | ChatCompletionRequest) -> int:
    if isinstance(req, ChatCompletionRequest) or isinstance(req.prompt, str):
        return 1
    return 1 if req.prompt and all(isinstance(x, int) for x in req.prompt) else len(req.prompt)


async def _collect(gen: Generation, n: int) -> list[Choice]:
    finals: list[tuple[int, RequestOutput]] = []
    async for pe in gen.events():
        if isinstance(pe.event, Ended):
            status = pe.event.status
            raise ApiError(status, pe.event.message, type=_REJECTION_TYPES.get(status, "server_error"))
        if pe.event.finished:
            finals.append((pe.index, pe.event))
    return [
        Choice(index=i * n + c.index, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs)
        for i, out in finals
        for c in out.outputs
    ]


async def _stream(
    gen: Generation, header: ResponseHeader, n: int, text: TokenText, include_usage: bool
) -> AsyncIterator[bytes]:
    total = len(gen.request_ids) * n
    done: set[int] = set()
    sent_lps: dict[int, int] = {}
    offsets: dict[int, int] = {}

    def chunks(pe: PromptEvent) -> Iterator[bytes]:
        event = pe.event
        if isinstance(event, Ended):
            if event.finish_reason == "error":
                yield sse(ApiError(event.status, event.message, type="server_error").body())
            for c in range(n):
                idx = pe.index * n + c
                if idx not in done:
                    done.add(idx)
                    yield sse(header.chunk(idx, delta=None, finish_reason=event.finish_reason,
                                           with_usage_field=include_usage))  # fmt: skip
            return
        for c in event.outputs:
            idx = pe.index * n + c.index
            if idx in done:
                continue
            new = c.logprobs[sent_lps.get(idx, 0) :] if c.logprobs is not None else []
            if not (c.delta or new or c.finish_reason):
                continue
            lp: dict[str, Any] | None = None
            if c.logprobs is not None and header.kind == "completion":
                lp = completion_logprobs(new, text, offsets.get(idx, 0))
            elif c.logprobs is not None:
                lp = chat_logprobs(new, text)
            sent_lps[idx] = sent_lps.get(idx, 0) + len(new)
            offsets[idx] = offsets.get(idx, 0) + len(c.delta)
            if c.finish_reason:
                done.add(idx)
            delta = c.delta if (c.delta or header.kind == "completion") else None
            yield sse(header.chunk(idx, delta=delta, finish_reason=c.finish_reason, logprobs=lp,
                                   with_usage_field=include_usage))  # fmt: skip

    out: list[bytes] = []
    if header.kind == "chat":
        out += [sse(header.chunk(i, delta="", finish_reason=None, role=True, with_usage_field=include_usage))
                for i in range(total)]  # fmt: skip
        yield b"".join(out)
        out.clear()
    async for pe in gen.events():
        out.extend(chunks(pe))
        # Chunks of events that arrived together (one engine step, or several once this stream fell behind) go
        # out as one write: one send through the ASGI server per batch rather than one per chunk.
        if out and not gen.has_pending:
            yield b"".join(out)
            out.clear()
    if include_usage:
        out.append(sse(header.usage_chunk(gen.stats.prompt_tokens, gen.stats.completion_tokens)))
    out.append(SSE_DONE)
    yield b"".join(out)


async def _prepare(
    service: Service,
    request: Request,
    req: CompletionRequest | ChatCompletionRequest,
    received: float,
    on_close: Callable[[Generation], None],
) -> tuple[Generation, EngineInfo, SamplingParams]:
    """Admit, wait for READY, tokenize, check, submit: the steps between a valid body and a running Generation."""
    ticket = service.admit(_num_prompts(req))
    try:
        info = await _unless_disconnected(request, service.wait_ready(service.serve_cfg.ready_wait))
        # Tokenizing a long prompt takes a while; off the event loop, other requests keep streaming meanwhile.
        if isinstance(req, CompletionRequest):
            params = req.sampling_params()
            prompts = await asyncio.to_thread(_completion_prompts, info, req, params)
        else:
            prompts, params = await asyncio.to_thread(_chat_prompt, info, req)
        service.admit_prompts(ticket, [len(p) for p in prompts])
    except BaseException:
        ticket.release_all()
        raise
    return service.generate(prompts, params, ticket, received_at=received, on_close=on_close), info, params


def make_router(service: Service, tracer: trace.Tracer) -> APIRouter:
    router = APIRouter()

    async def handle(request: Request, kind: Kind) -> Response:
        received = time.monotonic()
        rtrace = RequestTrace(
            tracer,
            request.headers,
            route=request.url.path,
            request_id=request_id(request),
            access=access_fields(request),
        )
        # The response status as the span should record it; set once the outcome is known.
        outcome = {"status": 200}
        try:
            model = CompletionRequest if kind == "completion" else ChatCompletionRequest
            req = parse_body(model, await request.body(), service.sampling_defaults.values)
            _check_model(service, req.model)
            req.sampling_params()  # range checks now, before the request waits for anything
            gen, info, params = await _prepare(
                service, request, req, received, lambda g: rtrace.finish(g.stats, outcome["status"])
            )
        except Rejected as r:
            err = _rejected(r)
            rtrace.fail(err.status, err.message)
            return err.response()
        except ApiError as err:
            if err.status in (400, 404):
                reason = "model_not_found" if err.code == "model_not_found" else "invalid_request"
                service.metrics.rejected.labels(reason=reason).inc()
            rtrace.fail(err.status, err.message)
            return err.response()
        except ClientGone:
            rtrace.fail(499, "the client disconnected before generation started")
            return Response(status_code=499)
        except BaseException as exc:
            rtrace.fail(500, f"{type(exc).__name__}: {exc}")
            raise

        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        header = ResponseHeader(
            id=f"{prefix}-{gen.request_ids[0].rsplit('-', 1)[0]}", model=service.model_name, kind=kind
        )
        text = TokenText(info.tokenizer)
        if req.streaming:
            return GenerationStream(_stream(gen, header, params.n, text, req.include_usage), gen)
        try:
            choices = await _unless_disconnected(request, _collect(gen, params.n))
        except ApiError as err:
            outcome["status"] = err.status
            return err.response()
        except ClientGone:
            outcome["status"] = 499
            return Response(status_code=499)
        finally:
            gen.close()
        return JSONResponse(header.body(choices, text, gen.stats.prompt_tokens, gen.stats.completion_tokens))

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = service.engine_info
        card: dict[str, Any] = {"id": service.model_name, "object": "model", "created": 0, "owned_by": "glowplug"}
        if info is not None:
            card["max_model_len"] = info.max_model_len
        # What a request's unset sampling fields become, and where that comes from (an extra field: OpenAI
        # clients ignore it).
        card["sampling_defaults"] = service.sampling_defaults.to_dict()
        return {"object": "list", "data": [card]}

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")

    return router
