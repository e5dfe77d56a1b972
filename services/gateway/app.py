"""The HTTP API: OpenAI-compatible routes over the Frontend, plus health and readiness."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway import responses, schemas
from services.gateway.errors import APIError, model_not_found
from services.gateway.frontend import Frontend, Generation
from shared.protocol import ChatRequest, CompletionRequest
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)
_OPEN_PATHS = {"/health", "/ready"}


async def read_json(request: Request, max_bytes: int) -> Any:
    content_type = request.headers.get("content-type", "")
    if "json" not in content_type:
        raise APIError(415, "Content-Type must be application/json")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the request body exceeds {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"the request body exceeds {max_bytes} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


class ApiKeyMiddleware:
    """Bearer API keys on every route but health/readiness, compared in constant time."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app, self.keys = app, [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.keys and scope["path"] not in _OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not any(hmac.compare_digest(token, key) for key in self.keys):
                error = APIError(401, "Incorrect or missing API key", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(settings: GatewaySettings) -> Starlette:
    frontend = Frontend(settings)

    async def chat_completions(request: Request) -> Response:
        req = schemas.parse(schemas.ChatCompletionRequest, await read_json(request, settings.max_body_bytes), settings)
        wire = ChatRequest(
            request_id=frontend.new_request_id("chatcmpl"), reply_to=settings.gateway_id, model=req.model,
            messages=[m.as_template_input() for m in req.messages], sampling=schemas.sampling_dict(req),
            max_tokens=req.token_budget, stream=req.stream, arrival_time=time.time(),
            traceparent=request.headers.get("traceparent"), chat_template_kwargs=req.chat_template_kwargs or {},
        )
        gen = await frontend.submit(wire, req.stop_strings, req.n)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return _event_stream(_chat_events(gen, include_usage))
        return await _collect(request, gen, is_chat=True)

    async def completions(request: Request) -> Response:
        req = schemas.parse(schemas.CompletionRequest, await read_json(request, settings.max_body_bytes), settings)
        wire = CompletionRequest(
            request_id=frontend.new_request_id("cmpl"), reply_to=settings.gateway_id, model=req.model,
            prompt=req.prompt, sampling=schemas.sampling_dict(req), max_tokens=req.token_budget, stream=req.stream,
            arrival_time=time.time(), traceparent=request.headers.get("traceparent"),
        )
        gen = await frontend.submit(wire, req.stop_strings, req.n)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        echo = _echo_text(gen) if req.echo else ""
        if req.stream:
            return _event_stream(_completion_events(gen, include_usage, echo))
        return await _collect(request, gen, is_chat=False, prefix=echo)

    def _echo_text(gen: Generation) -> str:
        return str(gen.choices[0].tokenizer.decode(gen.accepted.prompt_token_ids, skip_special_tokens=True))

    async def _chat_events(gen: Generation, include_usage: bool) -> AsyncIterator[bytes]:
        tokenizer, seen = gen.choices[0].tokenizer, set()
        async for update in gen.updates():
            if update.text or update.finish_reason or update.logprobs or update.index not in seen:
                chunk = responses.chat_chunk(gen, update, update.index not in seen, tokenizer)
                seen.add(update.index)
                yield responses.sse({**chunk, "usage": None} if include_usage else chunk)
        if include_usage:
            yield responses.sse(responses.usage_chunk(gen, "chat.completion.chunk"))

    async def _completion_events(gen: Generation, include_usage: bool, echo: str) -> AsyncIterator[bytes]:
        tokenizer = gen.choices[0].tokenizer
        offsets = [len(echo)] * len(gen.choices)
        if echo:
            for i in range(len(gen.choices)):
                yield responses.sse(responses._envelope(gen, "text_completion", [
                    {"index": i, "text": echo, "logprobs": None, "finish_reason": None}
                ]))
        async for update in gen.updates():
            if update.text or update.finish_reason or update.logprobs:
                chunk = responses.completion_chunk(gen, update, offsets[update.index], tokenizer)
                offsets[update.index] += len(update.text)
                yield responses.sse({**chunk, "usage": None} if include_usage else chunk)
        if include_usage:
            yield responses.sse(responses.usage_chunk(gen, "text_completion"))

    async def _collect(request: Request, gen: Generation, is_chat: bool, prefix: str = "") -> Response:
        """Gather a whole answer, aborting the request if the client goes away meanwhile."""
        tokenizer = gen.choices[0].tokenizer
        texts = [prefix] * len(gen.choices)
        logprobs: list[Any] = [None] * len(gen.choices)

        async def gather() -> None:
            async for u in gen.updates():
                if is_chat:
                    part = responses.chat_logprobs(tokenizer, u)
                else:
                    part = responses.completion_logprobs(tokenizer, u, len(texts[u.index]))
                logprobs[u.index] = responses.merge_logprobs(logprobs[u.index], part)
                texts[u.index] += u.text

        task = asyncio.create_task(gather())
        while not task.done():
            await asyncio.wait({task}, timeout=1.0)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)
        task.result()  # re-raises an APIError from the generation
        builder = responses.chat_response if is_chat else responses.completion_response
        return JSONResponse(builder(gen, texts, logprobs))

    async def list_models(request: Request) -> Response:
        data = [_model_card(m.name, m.first_seen, m.max_model_len) for m in frontend.registry.live_models()]
        return JSONResponse({"object": "list", "data": data})

    async def get_model(request: Request) -> Response:
        entry = frontend.registry.get(request.path_params["model"])
        if entry is None or not entry.is_live:
            raise model_not_found(request.path_params["model"])
        return JSONResponse(_model_card(entry.name, entry.first_seen, entry.max_model_len))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        is_ready = frontend.registry.is_redis_up and not frontend.is_draining and bool(frontend.registry.live_models())
        body = {"ready": is_ready, "redis": frontend.registry.is_redis_up,
                "models": [m.name for m in frontend.registry.live_models()]}
        return JSONResponse(body, status_code=200 if is_ready else 503)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await frontend.start()
        try:
            yield
        finally:
            frontend.is_draining = True
            await frontend.stop()

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return APIError(exc.status_code, str(exc.detail)).response()

    async def on_bug(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, "internal server error", type="internal_server_error").response()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan,
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_bug},
    )
    app.state.frontend = frontend
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys)
    return app


def _event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except APIError as exc:  # headers are out: the error goes in-band, then [DONE]
            yield responses.sse(exc.body())
        yield responses.sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _model_card(name: str, created: float, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(created), "owned_by": "pagedserve",
            "max_model_len": max_model_len}
