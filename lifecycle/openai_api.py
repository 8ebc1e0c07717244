"""`/v1/models`, `/v1/completions`, `/v1/chat/completions`: OpenAI-compatible, streamed (SSE) or not.

One request's path: read the body within its size and time limits (413, 408; transport.py), parse and
shape-check it (400: depth, UTF-8, JSON, Unicode, fields), validate its SamplingParams (400s come before anything
waits), take admission slots (429), wait for READY (503 after `ready_wait`), tokenize and check lengths, hand
the prompts to the engine core's client, then stream or collect. A client that goes away at any point aborts its
engine requests; `Generation.close()` in the response's `finally` makes that hold even for cancelled handlers. Its
disconnect is noted on the access-log line and counted by stage (never logged as an error).

No request stalls the others: a prompt whose length in characters already proves it longer than max-model-len is
refused before tokenizing (in a large completions body, while the body arrives, as soon as the part of the prompt
received proves it: the rest is dropped unread), and the rest is tokenized in bounded pieces with the GIL released
(engine/tokenizer.py, `encode_bounded`), stopping once the count passes max-model-len.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from starlette.types import Receive, Scope, Send

from glowplug.engine.fim import FimTokens, encode_fim, fim_tokens
from glowplug.engine.models.arch import ModelError
from glowplug.engine.outputs import check_logit_bias
from glowplug.engine.sampling_params import SamplingParams
from glowplug.engine.tokenizer import (
    PromptTooLong,
    encode_bounded,
    encode_chat,
    max_token_chars,
    template_takes_tools,
)

from .errors import ApiError, bad_request
from .generation import Ended, Generation, PromptEvent
from .json_limits import PromptScan, min_chars, top_level_string
from .metrics import DisconnectStage, RejectReason
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
from .tool_calls import ParseEvents, ToolCallParser, tag_token_ids
from .transport import (
    BodyBuffer,
    BodyWatch,
    ClientDisconnected,
    TransportLimits,
    content_length,
    note_disconnect,
    read_body,
)

if TYPE_CHECKING:
    from glowplug.engine.outputs import RequestOutput

T = TypeVar("T")

_REJECTION_TYPES = {429: "rate_limit_error", 503: "service_unavailable"}
# Refusals whose reason label says more than "invalid_request", by the error's code (the transport's own 401, 408,
# 413 and 431 are counted where they are raised).
_REASON_BY_CODE = {
    "model_not_found": RejectReason.MODEL_NOT_FOUND,
    "json_too_deep": RejectReason.JSON_TOO_DEEP,
    "invalid_unicode": RejectReason.INVALID_UNICODE,
    "too_many_values": RejectReason.TOO_MANY_VALUES,
}
# Bodies larger than this are parsed on a worker thread: the depth scan runs in numpy with the GIL released, and
# the event loop serves other requests between the steps that hold it. Smaller ones are parsed inline, where the
# hop to a thread would cost more than the parse.
_THREAD_PARSE_BYTES = 256 * 1024


class ClientGone(Exception):
    """The client disconnected while the server was still working on its request."""


class GenerationStream(StreamingResponse):
    """A streaming response that closes its Generation however the stream ends (done, error, disconnect), and
    notes a client that left before the last chunk."""

    def __init__(self, content: AsyncIterator[bytes], generation: Generation, service: Service) -> None:
        self._finished = False
        super().__init__(
            self._watch(content),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._generation = generation
        self._service = service

    async def _watch(self, content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in content:
            yield chunk
        self._finished = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.close()
            if not self._finished:
                # Starlette stopped the stream because the client disconnected (a drain that aborts ends the
                # stream normally, with finish_reason "abort").
                note_disconnect(scope, self._service.metrics, DisconnectStage.RESPONSE)


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


def rejected_error(r: Rejected) -> ApiError:
    headers = {"Retry-After": str(r.retry_after)} if r.retry_after is not None else None
    kind = _REJECTION_TYPES.get(r.status, "server_error")
    return ApiError(r.status, r.message, type=kind, code=r.reason, headers=headers)


def check_model(service: Service, model: str | None) -> None:
    """404 `model_not_found` for a model this server does not serve (OpenAI's and vLLM's answer); none = ours, and
    so is any name in `service.model_names` (the served name, and the path it was given as)."""
    if model is not None and model not in service.model_names:
        raise ApiError(
            404,
            f"the model `{model}` does not exist on this server; it serves `{service.model_name}` (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def _too_long(param: str, message: str) -> ApiError:
    return bad_request(f"{param}: {message}", param, code="context_length_exceeded")


def _check_prompt(info: EngineInfo, tokens: list[int], params: SamplingParams, param: str) -> None:
    if len(tokens) > info.max_model_len:
        # Before the engine's own check, which looks at every id: an id list longer than the whole context is
        # refused by its length alone.
        total = len(tokens) + params.max_tokens
        raise _too_long(
            param,
            f"prompt tokens ({len(tokens)}) + max_tokens ({params.max_tokens}) = {total} exceeds max-model-len "
            f"({info.max_model_len}); shorten the prompt or lower max_tokens",
        )
    try:
        info.validate_request(tokens, params)
    except ValueError as exc:
        code = "context_length_exceeded" if "max-model-len" in str(exc) else None
        raise bad_request(f"{param}: {exc}", param, code=code) from None


def _refuse_long(param: str, exc: PromptTooLong, info: EngineInfo) -> ApiError:
    """The context_length_exceeded 400 for a prompt refused before (or while) it was tokenized: one longer than the
    whole context. Prompts that fit are tokenized in full and checked by the engine (with max_tokens)."""
    return _too_long(
        param,
        f"the prompt has at least {exc.at_least:,} tokens ({exc.basis}), more than max-model-len "
        f"({info.max_model_len}); shorten the prompt",
    )


def _check_logit_bias(info: EngineInfo, params: SamplingParams) -> None:
    try:
        check_logit_bias(params, info.vocab_size)
    except ValueError as exc:
        raise bad_request(str(exc), "logit_bias") from None


def _fim(info: EngineInfo, req: CompletionRequest) -> FimTokens | None:
    """The FIM tokens a request with a `suffix` is built with (None without one); a 400 when the model has none."""
    if req.suffix is None:
        return None
    fim = fim_tokens(info.tokenizer)
    if fim is None:
        raise bad_request(
            "suffix: this model has no fill-in-the-middle tokens (such as Qwen2.5-Coder's "
            "<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>), so it cannot complete between a prompt "
            "and a suffix; drop suffix, or serve a model trained for FIM",
            "suffix",
        )
    return fim


def _completion_prompts(
    info: EngineInfo, req: CompletionRequest, params: SamplingParams, fim: FimTokens | None = None
) -> list[list[int]]:
    """Each prompt's ids; with `fim`, each is the prefix of a fill-in-the-middle prompt with the request's suffix."""
    p = req.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif p and all(isinstance(x, int) for x in p):
        raw = [list(p)]  # type: ignore[arg-type]
    else:
        raw = list(p)  # type: ignore[arg-type]
    prompts = []
    for i, item in enumerate(raw):
        param = "prompt" if len(raw) == 1 else f"prompt[{i}]"
        try:
            if fim is not None:
                tokens = encode_fim(info.tokenizer, fim, item, req.suffix or "", limit=info.max_model_len)
            elif isinstance(item, str):
                tokens = encode_bounded(info.tokenizer, item, limit=info.max_model_len)
            else:
                tokens = list(item)
        except PromptTooLong as exc:
            raise _refuse_long(param, exc, info) from None
        _check_prompt(info, tokens, params, param)
        prompts.append(tokens)
    return prompts


def _chat_prompt(info: EngineInfo, req: ChatCompletionRequest) -> tuple[list[list[int]], SamplingParams]:
    try:
        native = template_takes_tools(info.tokenizer)
        tools = req.tool_dicts() if req.parses_tools and native else None
        tokens = encode_chat(info.tokenizer, req.message_dicts(native), limit=info.max_model_len, tools=tools)
    except ModelError as exc:
        raise bad_request(str(exc), "messages") from None
    except PromptTooLong as exc:
        raise _refuse_long("messages", exc, info) from None
    left = info.max_model_len - len(tokens)
    if req.requested_max_tokens is None and left < 1:
        raise bad_request(
            f"the messages take {len(tokens)} tokens, the whole max-model-len ({info.max_model_len}); shorten them",
            "messages",
            code="context_length_exceeded",
        )
    params = req.sampling_params(max_tokens=left)
    tags = tag_token_ids(info.tokenizer) if req.forced_tools is not None else None
    if tags is not None:  # the forced calls' tags as the vocabulary's own tokens
        params = params.model_copy(update={"grammar": req.forced_tool_grammar(tags)})
    _check_prompt(info, tokens, params, "messages")
    return [tokens], params


def _echo_texts(info: EngineInfo, req: CompletionRequest) -> list[str] | None:
    """What `echo` puts before each prompt's completions: the prompt as sent (a string as it is, ids decoded; with
    a suffix, the prefix); None without echo."""
    if not req.echo:
        return None
    p = req.prompt
    items: list[Any] = [p] if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else list(p)
    return [x if isinstance(x, str) else info.tokenizer.decode(list(x), skip_special_tokens=False) for x in items]


def _num_prompts(req: CompletionRequest | ChatCompletionRequest) -> int:
    if isinstance(req, ChatCompletionRequest) or isinstance(req.prompt, str):
        return 1
    return 1 if req.prompt and all(isinstance(x, int) for x in req.prompt) else len(req.prompt)


def _with_tool_calls(choice: Choice, names: list[str]) -> Choice:
    """A chat choice's text read for tool calls of the functions `names`: the calls as OpenAI tool_calls, the rest
    as content, and finish reason "tool_calls" when the model stopped after calling."""
    parser = ToolCallParser(names)
    parser.feed(choice.text)
    parser.finish()
    if not parser.calls:
        return choice
    reason = "tool_calls" if choice.finish_reason == "stop" else choice.finish_reason
    return Choice(choice.index, parser.content.strip(), reason, choice.logprobs, [c.to_dict() for c in parser.calls])


def _ended_error(event: Ended, grammar_param: str | None) -> ApiError:
    """The error an engine-side end carries; a 400 (the core refused the request's grammar: one that matches no
    output) names `grammar_param`, the field the grammar came from."""
    param = grammar_param if event.status == 400 else None
    kind = _REJECTION_TYPES.get(event.status, "server_error" if event.status >= 500 else "invalid_request_error")
    return ApiError(event.status, f"{param}: {event.message}" if param else event.message, param=param, type=kind)


async def _collect(
    gen: Generation, n: int, tools: list[str] | None = None, grammar_param: str | None = None
) -> list[Choice]:
    """The finished choices; `grammar_param`: what a 400 from the engine names (`_ended_error`)."""
    finals: list[tuple[int, RequestOutput]] = []
    async for pe in gen.events():
        if isinstance(pe.event, Ended):
            raise _ended_error(pe.event, grammar_param)
        if pe.event.finished:
            finals.append((pe.index, pe.event))
    choices = [
        Choice(index=i * n + c.index, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs)
        for i, out in finals
        for c in out.outputs
    ]
    return [_with_tool_calls(c, tools) for c in choices] if tools is not None else choices


def _tool_chunks(
    header: ResponseHeader,
    idx: int,
    parser: ToolCallParser,
    delta: str,
    finish_reason: str | None,
    lp: dict[str, Any] | None,
    usage_field: bool,
) -> Iterator[bytes]:
    """A chat stream's chunks for one choice whose text is read for tool calls: its content, then each new call's
    id and name (arguments ""), then argument fragments, then the finish reason ("tool_calls" after calls)."""
    ev = parser.feed(delta) if delta else ParseEvents()
    if finish_reason is not None:
        end = parser.finish()
        ev.content += end.content
        ev.new_calls += end.new_calls
        ev.arguments += end.arguments
    pieces: list[tuple[str | None, list[dict[str, Any]] | None]] = []
    if ev.content:
        pieces.append((ev.content, None))
    for i, call in ev.new_calls:
        pieces.append(
            (None, [{"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}])
        )
    for i, fragment in ev.arguments:
        pieces.append((None, [{"index": i, "function": {"arguments": fragment}}]))
    for k, (content, calls) in enumerate(pieces):
        yield sse(
            header.chunk(
                idx,
                delta=content,
                finish_reason=None,
                logprobs=lp if k == 0 else None,
                with_usage_field=usage_field,
                tool_calls=calls,
            )
        )
    if finish_reason is not None or (lp is not None and not pieces):
        reason = "tool_calls" if finish_reason == "stop" and parser.calls else finish_reason
        yield sse(
            header.chunk(
                idx, delta=None, finish_reason=reason, logprobs=None if pieces else lp, with_usage_field=usage_field
            )
        )


async def _stream(
    gen: Generation,
    header: ResponseHeader,
    n: int,
    text: TokenText,
    include_usage: bool,
    tools: list[str] | None = None,
    echo: list[str] | None = None,
    grammar_param: str | None = None,
) -> AsyncIterator[bytes]:
    """`echo`: each prompt's text, sent before the first text of each of its completions; `grammar_param`: what
    an error event for a grammar the engine refused names."""
    total = len(gen.request_ids) * n
    echoed: set[int] = set()
    done: set[int] = set()
    sent_lps: dict[int, int] = {}
    offsets: dict[int, int] = {}
    parsers: dict[int, ToolCallParser] = {}

    def chunks(pe: PromptEvent) -> Iterator[bytes]:
        event = pe.event
        if isinstance(event, Ended):
            if event.finish_reason == "error":
                yield sse(_ended_error(event, grammar_param).body())
            for k in range(n):
                idx = pe.index * n + k
                if idx not in done:
                    done.add(idx)
                    yield sse(
                        header.chunk(idx, delta=None, finish_reason=event.finish_reason, with_usage_field=include_usage)
                    )
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
            if tools is not None:
                parser = parsers.setdefault(idx, ToolCallParser(tools))
                yield from _tool_chunks(header, idx, parser, c.delta, c.finish_reason, lp, include_usage)
                continue
            delta = c.delta if (c.delta or header.kind == "completion") else None
            if echo is not None and idx not in echoed:
                echoed.add(idx)
                delta = echo[pe.index] + (delta or "")
            yield sse(
                header.chunk(
                    idx, delta=delta, finish_reason=c.finish_reason, logprobs=lp, with_usage_field=include_usage
                )
            )

    out: list[bytes] = []
    if header.kind == "chat":
        out += [
            sse(header.chunk(i, delta="", finish_reason=None, role=True, with_usage_field=include_usage))
            for i in range(total)
        ]
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
    ticket = service.admission.admit(_num_prompts(req))
    try:
        info = await _unless_disconnected(request, service.wait_ready(service.serve_cfg.ready_wait))
        # Tokenizing a long prompt takes a while; off the event loop (and with the GIL released while the tokenizer
        # works), other requests keep streaming meanwhile.
        _check_logit_bias(info, req.sampling_params())
        if isinstance(req, CompletionRequest):
            fim = _fim(info, req)
            params = req.sampling_params(fim.end_ids if fim is not None else ())
            prompts = await asyncio.to_thread(_completion_prompts, info, req, params, fim)
        else:
            prompts, params = await asyncio.to_thread(_chat_prompt, info, req)
        service.admission.admit_prompts(ticket, [len(p) for p in prompts])
    except BaseException:
        ticket.release_all()
        raise
    return service.generate(prompts, params, ticket, received_at=received, on_close=on_close), info, params


def _chars_refusal(chars: int, longest: int, info: EngineInfo) -> ApiError | None:
    """The context_length_exceeded 400 for a prompt of at least `chars` characters when that many cannot fit
    (no token covers more than `longest` of them); None when they might."""
    at_least = math.ceil(chars / longest)
    if at_least <= info.max_model_len:
        return None
    basis = f"it is at least {chars:,} characters and no token of this tokenizer covers more than {longest}"
    return _refuse_long("prompt", PromptTooLong(at_least, info.max_model_len, chars, basis), info)


def _refuse_raw_prompt(raw: BodyBuffer, info: EngineInfo) -> None:
    """Refuse a completions prompt too long to fit from the body's bytes, before parsing: parsed, it would be held
    twice (the body, and the string json.loads makes of it). Its bytes bound its characters from below
    (`min_chars`), and those its tokens, as after parsing."""
    longest = max_token_chars(info.tokenizer)
    if longest is None:
        return
    view = raw.view()
    try:
        span = top_level_string(view, b"prompt")
        chars = min_chars(view, *span) if span is not None else 0
    finally:
        view.release()
    refusal = _chars_refusal(chars, longest, info)
    if refusal is not None:
        raise refusal


async def _prompt_watch(
    scope: Scope, model: type[CompletionRequest] | type[ChatCompletionRequest], info: EngineInfo | None
) -> BodyWatch | None:
    """For a completions body large enough to hold a prompt that cannot fit: a watch that refuses it as soon as the
    part of its prompt already received proves that (`PromptScan`), so the rest of the body is never read, copied
    or scanned (a 16 MiB prompt is refused after its first few hundred KB). None for every other body."""
    if model is not CompletionRequest or info is None:
        return None
    declared = content_length(scope)
    if declared is not None and declared <= _THREAD_PARSE_BYTES:
        return None
    # Off the loop: the first call reads the vocabulary (tens of ms); later ones return the cached value.
    longest = await asyncio.to_thread(max_token_chars, info.tokenizer)
    if longest is None or (declared is not None and declared <= longest * info.max_model_len):
        return None  # a prompt the body can hold may fit: it is read, parsed and tokenized (in bounded pieces)
    scan = PromptScan(b"prompt")

    def watch(body: BodyBuffer) -> ApiError | None:
        view = body.view()
        try:
            chars = scan.feed(view)
        finally:
            view.release()
        return _chars_refusal(chars, longest, info)

    return watch


def _parse_large(
    model: type[CompletionRequest] | type[ChatCompletionRequest],
    raw: BodyBuffer,
    limits: TransportLimits,
    info: EngineInfo | None,
    defaults: Mapping[str, Any],
) -> CompletionRequest | ChatCompletionRequest:
    try:
        if model is CompletionRequest and info is not None:
            _refuse_raw_prompt(raw, info)
    except BaseException:
        raw.release()
        raise
    return parse_body(model, raw, limits.max_json_depth, limits.max_json_values, defaults)


async def _read_request(
    request: Request,
    model: type[CompletionRequest] | type[ChatCompletionRequest],
    limits: TransportLimits,
    service: Service,
) -> CompletionRequest | ChatCompletionRequest:
    """Read the body within its limits and parse it into `model` (ApiError or ClientDisconnected otherwise)."""
    watch = await _prompt_watch(request.scope, model, service.engine_info)
    raw = await read_body(request.scope, request.receive, limits, service.metrics, watch)
    if len(raw) > _THREAD_PARSE_BYTES:
        # Before READY there is no tokenizer to bound the prompt with; it is then checked after tokenizing.
        return await asyncio.to_thread(
            _parse_large, model, raw, limits, service.engine_info, service.sampling_defaults.values
        )
    return parse_body(model, raw, limits.max_json_depth, limits.max_json_values, service.sampling_defaults.values)


def make_router(service: Service, tracer: trace.Tracer) -> APIRouter:
    router = APIRouter()
    limits = TransportLimits.from_config(service.serve_cfg)

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
            req = await _read_request(request, model, limits, service)
            check_model(service, req.model)
            req.sampling_params()  # range checks now, before the request waits for anything
            gen, info, params = await _prepare(
                service, request, req, received, lambda g: rtrace.finish(g.stats, outcome["status"])
            )
        except Rejected as r:
            err = rejected_error(r)
            rtrace.fail(err.status, err.message)
            return err.response()
        except ApiError as err:
            if err.status in (400, 404) or err.code in _REASON_BY_CODE:
                reason = _REASON_BY_CODE.get(err.code or "", RejectReason.INVALID_REQUEST)
                service.metrics.rejected.labels(reason=reason).inc()
            rtrace.fail(err.status, err.message)
            return err.response()
        except ClientDisconnected as gone:
            note_disconnect(request.scope, service.metrics, gone.stage)
            rtrace.fail(499, str(gone))
            return Response(status_code=499)
        except ClientGone:
            note_disconnect(request.scope, service.metrics, DisconnectStage.WAITING)
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
        # The functions a chat reply is read for calls of (None: it is not read).
        tools = (
            [t["function"]["name"] for t in req.tool_dicts()]
            if (isinstance(req, ChatCompletionRequest) and req.parses_tools)
            else None
        )
        echo = _echo_texts(info, req) if isinstance(req, CompletionRequest) else None
        if req.streaming:
            stream = _stream(gen, header, params.n, text, req.include_usage, tools, echo, req.grammar_param)
            return GenerationStream(stream, gen, service)
        try:
            choices = await _unless_disconnected(request, _collect(gen, params.n, tools, req.grammar_param))
            if echo is not None:
                choices = [
                    Choice(c.index, echo[c.index // params.n] + c.text, c.finish_reason, c.logprobs) for c in choices
                ]
        except ApiError as err:
            outcome["status"] = err.status
            return err.response()
        except ClientGone:
            note_disconnect(request.scope, service.metrics, DisconnectStage.RESPONSE)
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
