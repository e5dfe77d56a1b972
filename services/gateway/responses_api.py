"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: text in, text out, streamed or not.

    input (a string, or messages with input_text / output_text parts) + instructions
        -> the chat request the rest of the pipeline serves (validation, template, sampling as chat's)
        -> one `message` output item with one `output_text` part

Streaming sends the typed events the official clients read, in order: response.created,
response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta..., response.output_text.done, response.content_part.done,
response.output_item.done, response.completed (or response.incomplete at max_output_tokens; an error
after the headers is an `error` event). Nothing is stored: `previous_response_id` and `store: true`
lookups are refused, and so are tools here (use /v1/chat/completions for tool calling).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.services.gateway import schemas
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Frontend, Generation
from pagedserve.services.gateway.messages import Strict
from pagedserve.services.gateway.streaming import event_stream
from pagedserve.services.gateway.validation import validate
from pagedserve.services.gateway.wire_request import to_wire
from pagedserve.shared.config import GatewayConfig

_DISCONNECT_POLL_S = 1.0


class InputText(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None


class InputMessage(Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class ResponsesRequest(Strict):
    model: str = Field(min_length=1)
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def is_stream(self) -> bool:
        return self.stream

    @property
    def token_budget(self) -> int | None:
        return self.max_output_tokens


def chat_request_of(req: ResponsesRequest) -> schemas.ChatCompletionRequest:
    """The chat completion this response is, validated as chat's are."""
    if req.previous_response_id is not None:
        raise APIError(
            400,
            "previous_response_id: this server stores no responses; send the whole conversation as input",
            param="previous_response_id",
        )
    if req.tools:
        raise APIError(
            400, "tools: /v1/responses serves text here; use /v1/chat/completions for tool calling", param="tools"
        )
    fmt = (req.text or {}).get("format") or {}
    if fmt.get("type") not in (None, "text"):
        raise APIError(
            400, "text.format: only text output here; use /v1/chat/completions' response_format", param="text.format"
        )
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for item in req.input:
            text = item.content if isinstance(item.content, str) else "".join(part.text for part in item.content)
            messages.append({"role": item.role, "content": text})
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "prompt_cache_key": req.prompt_cache_key,
    }
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["reasoning_effort"] = effort
    return validate(schemas.ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


async def serve(request: Request, req: ResponsesRequest, frontend: Frontend, settings: GatewayConfig) -> Response:
    chat = chat_request_of(req)
    schemas.check_limits(chat, settings)
    gen = await frontend.submit(
        to_wire(
            chat, frontend.new_request_id("resp"), settings.gateway_id, traceparent=request.headers.get("traceparent")
        ),
        chat.stop_strings,
        1,
    )
    shape = _Shape(req, gen)
    if req.stream:  # keep-alives, and the request released however the stream ends (streaming.py)
        return event_stream(gen, _events(gen, shape), settings.sse_keepalive_s, done=False)
    text = await _gather_text(request, gen)
    return JSONResponse(shape.response(text, done=True)) if text is not None else Response(status_code=499)


async def _gather_text(request: Request, gen: Generation) -> str | None:
    """The whole answer, or None if the client went away first (the request is then aborted)."""
    parts: list[str] = []

    async def gather() -> None:
        async for update in gen.updates():
            parts.append(update.text)

    task = asyncio.create_task(gather())
    while not task.done():
        await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # updates() ends in its `finally`: the engine gets an Abort
            await asyncio.gather(task, return_exceptions=True)
            return None
    task.result()  # re-raises an APIError from the generation
    return "".join(parts)


class _Shape:
    """The response object and its items, with the ids they keep from first event to last."""

    def __init__(self, req: ResponsesRequest, gen: Generation) -> None:
        self.req, self.gen = req, gen
        self.id = f"resp_{gen.request_id.rpartition('-')[2]}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def message(self, text: str, done: bool) -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
        return {
            "type": "message",
            "id": self.message_id,
            "status": "completed" if done else "in_progress",
            "role": "assistant",
            "content": content,
        }

    def response(self, text: str | None, done: bool) -> dict[str, Any]:
        usage = self.gen.usage()
        truncated = self.gen.finish_reasons.get(0) == "length"
        status = "in_progress" if not done else "incomplete" if truncated else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.gen.served_model,
            "output": [] if text is None else [self.message(text, done)],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if done and truncated else None,
            "instructions": self.req.instructions,
            "max_output_tokens": self.req.max_output_tokens,
            "metadata": self.req.metadata or {},
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "temperature": self.req.temperature,
            "top_p": self.req.top_p,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": False,
            "usage": None
            if not done
            else {
                "input_tokens": usage["prompt_tokens"],
                "output_tokens": usage["completion_tokens"],
                "total_tokens": usage["total_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }


async def _events(gen: Generation, shape: _Shape) -> AsyncIterator[bytes]:
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        payload = orjson.dumps({"type": kind, "sequence_number": sequence - 1, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    item = {"item_id": shape.message_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=shape.response(None, done=False))
    yield event("response.in_progress", response=shape.response(None, done=False))
    yield event("response.output_item.added", output_index=0, item=shape.message("", done=False))
    yield event("response.content_part.added", **item, part={"type": "output_text", "text": "", "annotations": []})
    text = ""
    try:
        async for update in gen.updates():
            if update.text:
                text += update.text
                yield event("response.output_text.delta", **item, delta=update.text, logprobs=[])
    except APIError as exc:  # the headers are out: the error goes in-band
        yield event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
        return
    yield event("response.output_text.done", **item, text=text, logprobs=[])
    yield event("response.content_part.done", **item, part={"type": "output_text", "text": text, "annotations": []})
    yield event("response.output_item.done", output_index=0, item=shape.message(text, done=True))
    final = shape.response(text, done=True)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
