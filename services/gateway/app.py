"""The HTTP API: OpenAI-compatible routes over the Frontend, plus helpers, health and readiness.

request ─► ApiKeyMiddleware ─► read_json + validate + check_limits ─► Frontend.submit
        (401)                  (413, 415, 400 naming the param)       (404, 429, 503, and the
                                                                        tokenizer's 400s)
        ─► SSE stream (streaming.event_stream) or one JSON body (streaming.collect)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pagedserve.services.gateway import (
    beam_response,
    ignored_fields,
    lora_routes,
    responses,
    responses_api,
    schemas,
    streaming,
    structured,
    token_routes,
)
from pagedserve.services.gateway import completions as completions_route
from pagedserve.services.gateway import embeddings as embeddings_route
from pagedserve.services.gateway.auth import ApiKeyMiddleware, is_authorized
from pagedserve.services.gateway.errors import APIError, model_not_found
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.lora_routes import adapter_card, adapter_cards
from pagedserve.services.gateway.metrics import GatewayMetrics, MetricsMiddleware
from pagedserve.services.gateway.reasoning import PARSERS, gate_grammar, text_options_for
from pagedserve.services.gateway.response_items import item_page
from pagedserve.services.gateway.response_store import ResponseStore
from pagedserve.services.gateway.response_store import not_found as response_not_found
from pagedserve.services.gateway.tool_calls import text_options as tool_text_options
from pagedserve.services.gateway.tool_calls import tool_call_states
from pagedserve.services.gateway.validation import read_json, validate, validate_ignoring_unknown
from pagedserve.services.gateway.wire_request import to_wire
from pagedserve.services.gateway.worker_readiness import WorkerReadiness
from pagedserve.shared.config import Config

log = logging.getLogger(__name__)


def build_app(config: Config, workers: WorkerReadiness | None = None) -> Starlette:
    settings = config.gateway
    frontend = Frontend(config, workers)
    metrics = frontend.metrics = GatewayMetrics()
    metrics.watch_engines(frontend.registry)
    metrics.track_in_flight(lambda: frontend.num_in_flight)
    ignored_log = ignored_fields.IgnoredFieldsLog()
    reasoning = PARSERS[settings.reasoning_parser] if settings.reasoning_parser else None
    store = ResponseStore(frontend.redis, settings.responses_store_ttl_s)  # in Redis: shared by every worker

    async def parse(request: Request, cls: type[Any]) -> tuple[Any, list[str]]:
        """The validated request, and the unknown fields it came with (dropped; none when strict)."""
        body = await read_json(request, settings.max_body_bytes)
        ignored: list[str] = []
        if settings.strict_request_fields:
            req = validate(cls, body)
        else:
            req, ignored = validate_ignoring_unknown(cls, body)
        if isinstance(req, schemas.ChatCompletionRequest | schemas.CompletionRequest):  # /v1/responses: as its chat
            schemas.check_limits(req, settings)
        if not settings.enable_auto_tool_choice and structured.tool_choice_mode(req) == "auto":
            raise APIError(
                400, '"auto" tool choice needs a server started with --enable-auto-tool-choice', param="tool_choice"
            )
        if ignored:
            ignored_log.warn(request.url.path, ignored)
        if not settings.disable_log_requests:  # vLLM's per-request line; --disable-log-requests turns it off
            log.info(
                "request %s model=%s stream=%s max_tokens=%s",
                request.url.path,
                req.model,
                req.is_stream,
                req.token_budget,
            )
        return req, ignored

    async def chat_completions(request: Request) -> Response:
        req, ignored = await parse(request, schemas.ChatCompletionRequest)
        return _reporting(await chat_response(request, req), ignored)

    async def chat_response(request: Request, req: schemas.ChatCompletionRequest) -> Response:
        wire = to_wire(
            req,
            frontend.new_request_id("chatcmpl"),
            settings.gateway_id,
            traceparent=request.headers.get("traceparent"),
        )
        echo = req.echo_text
        mode = structured.tool_choice_mode(req)
        if settings.tool_call_grammar and not req.use_beam_search:
            tag = structured.auto_tool_grammar(req, settings.tool_call_parser)
            if tag is not None:
                wire.sampling["structured_output"] = tag.to_wire()
        gate_grammar(wire.sampling, reasoning, settings.grammar_in_reasoning)
        if req.use_beam_search:
            beam_response.check(req)
            response_id = f"chatcmpl-{req.request_id}" if req.request_id is not None else wire.request_id
            return await beam_response.respond(req, [wire], frontend, response_id, [echo])
        text_options = tool_text_options(mode, settings.tool_call_parser, req.text_options)
        try:
            gen = await frontend.submit(
                wire, req.stop_strings, req.num_choices, text_options_for(reasoning, text_options)
            )
        except APIError as exc:  # name the field the client actually sent
            if exc.param == "max_tokens" and req.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"
            raise
        if req.request_id is not None:  # the id the client chose names the response; ours stays unique inside
            gen.response_id = f"chatcmpl-{req.request_id}"
        named = req.tool_choice.function.name if isinstance(req.tool_choice, schemas.NamedToolChoice) else None
        tools = tool_call_states(
            mode,
            named,
            settings.tool_call_parser,
            req.num_choices,
            structured.template_tools(req),
            req.parallel_tool_calls,
        )
        if req.is_stream:
            fmt = streaming.StreamFormat(
                req.include_usage,
                req.continuous_usage,
                reasoning=reasoning,
                legacy_functions=req.uses_legacy_functions,
                return_token_ids=req.return_token_ids,
                echoes=[echo] if echo else [],
            )
            return streaming.event_stream(gen, streaming.chat_events(gen, fmt, tools), settings.sse_keepalive_s)
        k = req.prompt_logprobs  # vLLM's extra: prompt_logprobs at the top of the body (never streamed)

        def finish(body: dict[str, Any]) -> None:
            for choice in body["choices"] if echo else ():
                choice["message"]["content"] = echo + (choice["message"]["content"] or "")
            if k is not None:
                body.update(prompt_logprobs=responses.vllm_prompt_logprobs(gen.token_texts, gen, k))
            if req.uses_legacy_functions:
                responses.as_legacy_function_call(body)
            if req.return_token_ids:  # vLLM's: saves RL and eval frameworks a retokenization
                body["prompt_token_ids"] = list(gen.accepted.prompt_token_ids)
                for choice, text in zip(body["choices"], gen.choices):
                    choice["token_ids"] = list(text.token_ids)

        return await streaming.collect(request, gen, is_chat=True, tools=tools, finish=finish, reasoning=reasoning)

    async def completions(request: Request) -> Response:
        req, ignored = await parse(request, schemas.CompletionRequest)
        return _reporting(await completions_route.serve(request, req, frontend, settings), ignored)

    async def create_response(request: Request) -> Response:
        req, ignored = await parse(request, responses_api.ResponsesRequest)
        return _reporting(await responses_api.serve(request, req, frontend, settings, store, reasoning), ignored)

    async def get_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stored = await store.load(response_id)
        if stored is None:
            raise response_not_found(response_id)
        return JSONResponse(stored.response)

    async def list_input_items(request: Request) -> Response:
        response_id, query = request.path_params["response_id"], request.query_params
        stored = await store.load(response_id)
        if stored is None:
            raise response_not_found(response_id)
        limit, order = query.get("limit", "20"), query.get("order", "desc")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise APIError(400, "limit must be an integer from 1 to 100", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'", param="order")
        return JSONResponse(item_page(stored.input_items, query.get("after"), int(limit), order))

    async def delete_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not await store.delete(response_id):
            raise response_not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def embeddings(request: Request) -> Response:
        req, ignored = await parse(request, embeddings_route.EmbeddingRequest)
        return _reporting(await embeddings_route.serve(request, req, frontend, settings), ignored)

    async def list_models(request: Request) -> Response:
        await frontend.registry.refresh_now()
        # A listed model is one a request would be served for now: what clients wait on after a start
        data = [_model_card(m.name, m.first_seen, m.max_model_len) for m in frontend.registry.servable_models()]
        data += adapter_cards(frontend.registry)  # LoRA adapters, each with its `parent`
        return JSONResponse({"object": "list", "data": data})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        entry, lora_name = await frontend.registry.resolve(name)
        if entry is None or not entry.is_servable:
            raise model_not_found(name)
        if lora_name is not None:
            return JSONResponse(adapter_card(lora_name, entry.adapters[lora_name], entry))
        return JSONResponse(_model_card(entry.name, entry.first_seen, entry.max_model_len))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        await frontend.registry.refresh_now()  # every worker answers from what Redis holds now
        is_ready = frontend.is_ready_everywhere()
        body: dict[str, Any] = {"ready": is_ready, "redis": frontend.registry.is_redis_up}
        if _may_list_models(request):  # probes need no key; the served models are only for callers with one
            body["models"] = [m.name for m in frontend.registry.servable_models()]
        return JSONResponse(body, status_code=200 if is_ready else 503)

    def _may_list_models(request: Request) -> bool:
        keys = [k.encode() for k in settings.api_keys]
        return not keys or is_authorized(request.headers.get("authorization", "").encode(), keys)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await frontend.start()
        grpc_door = None
        if settings.grpc_port:
            from pagedserve.services.gateway.grpc_api import server as grpc_server  # grpc loads only when it serves

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
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        *lora_routes.routes(config.lora),
        Route("/tokenize", token_routes.tokenize, methods=["POST"]),
        Route("/detokenize", token_routes.detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: _on_api_error, HTTPException: _on_http_error, Exception: _on_bug},
    )
    app.state.frontend = frontend
    if settings.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: counts 401s too
    return app


def _reporting(response: Response, ignored: list[str]) -> Response:
    """`response` with the header naming the ignored fields (set before its first byte, streams too)."""
    if ignored:
        response.headers[ignored_fields.HEADER] = ignored_fields.header_value(ignored)
    return response


def _model_card(name: str, created: float, max_model_len: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(created),
        "owned_by": "pagedserve",
        "max_model_len": max_model_len,
    }


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
