"""`/tokenize` and `/detokenize` (vLLM's shapes), on the API server's own tokenizer.

The engine core never sees these requests: the server process holds the tokenizer (loaded from the core's model
folder at READY), and tokenizes here exactly as the generation endpoints do, so `/tokenize` of chat messages counts
the tokens a chat completion's prompt will have. Both wait for READY like a generation request (503 after
`ready_wait`), and go through the same transport limits and body parser.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from glowplug.engine.models.arch import ModelError
from glowplug.engine.tokenizer import encode_bounded, encode_chat, template_takes_tools

from .errors import ApiError, bad_request
from .openai_api import check_model, rejected_error
from .protocol import DetokenizeRequest, TokenizeRequest, parse_simple
from .service import EngineInfo, Rejected, Service
from .transport import ClientDisconnected, TransportLimits, note_disconnect, read_body


def tokenize(info: EngineInfo, req: TokenizeRequest) -> list[int]:
    """The ids of the request's prompt, or of its messages rendered by the chat template (with its tools)."""
    tokenizer = info.tokenizer
    if req.prompt is not None:
        special = req.add_special_tokens is not False
        return encode_bounded(tokenizer, req.prompt, limit=sys.maxsize, add_special_tokens=special)
    chat = req.chat()
    native = template_takes_tools(tokenizer)
    tools = chat.tool_dicts() if chat.parses_tools and native else None
    try:
        return encode_chat(
            tokenizer,
            chat.message_dicts(native),
            limit=sys.maxsize,
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            add_special_tokens=bool(req.add_special_tokens),
        )
    except ModelError as exc:
        raise bad_request(str(exc), "messages") from None


def detokenize(info: EngineInfo, req: DetokenizeRequest) -> str:
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"tokens[{bad}]: token id {req.tokens[bad]} is outside the vocabulary (0..{info.vocab_size - 1})",
            f"tokens[{bad}]",
        )
    return str(info.tokenizer.decode(req.tokens, skip_special_tokens=False))


def make_tokenize_router(service: Service) -> APIRouter:
    router = APIRouter()
    limits = TransportLimits.from_config(service.serve_cfg)

    async def ready_request(request: Request, model: type[Any]) -> tuple[Any, EngineInfo]:
        raw = await read_body(request.scope, request.receive, limits, service.metrics)
        req = parse_simple(model, raw, limits.max_json_depth, limits.max_json_values)
        check_model(service, req.model)
        return req, await service.wait_ready(service.serve_cfg.ready_wait)

    async def answer(request: Request, model: type[Any]) -> Response:
        try:
            req, info = await ready_request(request, model)
            if isinstance(req, TokenizeRequest):
                tokens = await asyncio.to_thread(tokenize, info, req)
                body: dict[str, Any] = {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}
                if req.return_token_strs:
                    convert = getattr(info.tokenizer, "backend", info.tokenizer)
                    body["token_strs"] = [convert.id_to_token(t) for t in tokens]
                return JSONResponse(body)
            return JSONResponse({"prompt": await asyncio.to_thread(detokenize, info, req)})
        except Rejected as r:
            return rejected_error(r).response()
        except ApiError as err:
            return err.response()
        except ClientDisconnected as gone:
            note_disconnect(request.scope, service.metrics, gone.stage)
            return Response(status_code=499)

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await answer(request, TokenizeRequest)

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await answer(request, DetokenizeRequest)

    return router
