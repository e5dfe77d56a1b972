"""The HTTP API: OpenAI-compatible routes over the Frontend, plus helpers, health and readiness.

    request ─► ApiKeyMiddleware ─► read_json + validate + check_limits ─► Frontend.submit
            (401)                  (413, 415, 400 naming the param)       (404, 429, 503, and the
                                                                            tokenizer's 400s)
            ─► SSE stream (streaming.event_stream) or one JSON body (streaming.collect)
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.gateway import completions as completions_route
from services.gateway import responses, schemas, streaming, structured, token_routes
from services.gateway.auth import ApiKeyMiddleware
from services.gateway.errors import APIError, model_not_found
from services.gateway.frontend import Frontend
from services.gateway.metrics import GatewayMetrics, MetricsMiddleware
from services.gateway.tool_calls import tool_call_states
from services.gateway.validation import read_json, validate
from shared.protocol import ChatRequest
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)


def build_app(settings: GatewaySettings) -> Starlette:
    frontend = Frontend(settings)
    metrics = frontend.metrics = GatewayMetrics()
    metrics.watch_engines(frontend.registry)
    metrics.track_in_flight(lambda: frontend.num_in_flight)

    async def parse(request: Request, cls: type[Any]) -> Any:
        req = validate(cls, await read_json(request, settings.max_body_bytes))
        schemas.check_limits(req, settings)
        if req.user:
            log.debug("request for user %s", req.user)
        return req

    async def chat_completions(request: Request) -> Response:
        req: schemas.ChatCompletionRequest = await parse(request, schemas.ChatCompletionRequest)
        wire = ChatRequest(
            request_id=frontend.new_request_id("chatcmpl"), reply_to=settings.gateway_id, model=req.model,
            messages=[m.as_template_input() for m in req.messages], sampling=schemas.sampling_dict(req),
            max_tokens=req.token_budget, stream=req.is_stream, arrival_time=time.time(),
            traceparent=request.headers.get("traceparent"), chat_template_kwargs=req.chat_template_kwargs or {},
            tools=structured.template_tools(req),
        )
        try:
            gen = await frontend.submit(wire, req.stop_strings, req.num_choices)
        except APIError as exc:  # name the field the client actually sent
            if exc.param == "max_tokens" and req.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise
        named = req.tool_choice.function.name if isinstance(req.tool_choice, schemas.NamedToolChoice) else None
        tools = tool_call_states(structured.tool_choice_mode(req), named, settings.tool_call_parser, req.num_choices)
        if req.is_stream:
            fmt = streaming.StreamFormat(req.include_usage, req.continuous_usage)
            return streaming.event_stream(streaming.chat_events(gen, fmt, tools))
        k = req.prompt_logprobs  # vLLM's extra: prompt_logprobs at the top of the body (never streamed)
        return await streaming.collect(request, gen, is_chat=True, tools=tools, finish=None if k is None else (
            lambda body: body.update(prompt_logprobs=responses.vllm_prompt_logprobs(gen.token_texts, gen, k))))

    async def completions(request: Request) -> Response:
        req: schemas.CompletionRequest = await parse(request, schemas.CompletionRequest)
        return await completions_route.serve(request, req, frontend, settings)

    async def embeddings(request: Request) -> Response:
        raise APIError(404, "This server does not serve embeddings (/v1/embeddings); it serves text generation "
                       "models only", code="not_found")

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
        is_ready = frontend.is_ready()
        body = {"ready": is_ready, "redis": frontend.registry.is_redis_up,
                "models": [m.name for m in frontend.registry.live_models()]}
        return JSONResponse(body, status_code=200 if is_ready else 503)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await frontend.start()
        grpc_door = None
        if settings.grpc_port:
            from services.gateway.grpc_api import server as grpc_server  # grpc loads only when it serves

            grpc_door = await grpc_server.start(frontend, settings)
        try:
            yield
        finally:
            frontend.is_draining = True
            if grpc_door is not None:
                await grpc_door.stop()
            await frontend.stop()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/tokenize", token_routes.tokenize, methods=["POST"]),
        Route("/detokenize", token_routes.detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan,
        exception_handlers={APIError: _on_api_error, HTTPException: _on_http_error, Exception: _on_bug},
    )
    app.state.frontend = frontend
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts 401s too
    return app


def _model_card(name: str, created: float, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(created), "owned_by": "pagedserve",
            "max_model_len": max_model_len}


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {})).response()


async def _on_bug(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return APIError(500, "internal server error", type="internal_server_error").response()
