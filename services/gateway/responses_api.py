"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) over the chat path.

    previous_response_id ─► its stored conversation (response_store.py), then `input` (a string or items)
        + instructions, tools, tool_choice, text.format
        -> the chat request the rest of the pipeline serves (validation, template, sampling as chat's)
        -> --reasoning-parser's split, then the tool-call parser's (as chat's), into output items:
           reasoning, message, function_call (response_output.py)
        -> stored in Redis with a TTL when `store` (true by default, as OpenAI's)

Streaming sends the typed events the official clients read, each with its sequence_number: response.created,
response.in_progress, each item's events (response_output.py), then response.completed (or response.incomplete
at max_output_tokens; an error after the headers is an `error` event). The response is stored before its last
event, so a client may continue it at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.services.gateway import schemas, structured
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Frontend, Generation
from pagedserve.services.gateway.messages import Strict
from pagedserve.services.gateway.reasoning import (
    ReasoningFormat,
    count_reasoning_tokens,
    gate_grammar,
    new_splitter,
    split_reasoning,
    text_options_for,
)
from pagedserve.services.gateway.response_items import (
    FunctionTool,
    InputItem,
    NamedFunction,
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_items,
)
from pagedserve.services.gateway.response_output import Event, OutputItems
from pagedserve.services.gateway.response_store import ResponseStore, not_found
from pagedserve.services.gateway.streaming import event_stream
from pagedserve.services.gateway.tool_calls import ChoiceToolCalls, tool_call_states
from pagedserve.services.gateway.tool_calls import text_options as tool_text_options
from pagedserve.services.gateway.validation import validate
from pagedserve.services.gateway.wire_request import to_wire
from pagedserve.shared.config import GatewayConfig

_DISCONNECT_POLL_S = 1.0


class ResponsesRequest(Strict):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    previous_response_id: str | None = Field(default=None, min_length=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    store: bool = True  # as OpenAI's default
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


def chat_request_of(req: ResponsesRequest, items: list[dict[str, Any]]) -> schemas.ChatCompletionRequest:
    """The chat completion this response is (the conversation so far as `items`), validated as chat's are."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages + chat_messages(items),
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "prompt_cache_key": req.prompt_cache_key,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": chat_response_format(req.text),
        "reasoning_effort": (req.reasoning or {}).get("effort"),
    }
    return validate(schemas.ChatCompletionRequest, {k: v for k, v in body.items() if v is not None})


async def serve(
    request: Request,
    req: ResponsesRequest,
    frontend: Frontend,
    settings: GatewayConfig,
    store: ResponseStore,
    reasoning: ReasoningFormat | None,
) -> Response:
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous = await store.load(req.previous_response_id)
        if previous is None:
            raise not_found(req.previous_response_id, param="previous_response_id")
        history = previous.conversation()
    items = history + input_items(req.input)
    chat = chat_request_of(req, items)
    schemas.check_limits(chat, settings)
    wire = to_wire(
        chat, frontend.new_request_id("resp"), settings.gateway_id, traceparent=request.headers.get("traceparent")
    )
    mode = structured.tool_choice_mode(chat)
    if settings.tool_call_grammar:  # as chat: a started call is held to the tools' schemas
        tag = structured.auto_tool_grammar(chat, settings.tool_call_parser)
        if tag is not None:
            wire.sampling["structured_output"] = tag.to_wire()
    gate_grammar(wire.sampling, reasoning, settings.grammar_in_reasoning)
    text_options = tool_text_options(mode, settings.tool_call_parser, chat.text_options)
    gen = await frontend.submit(wire, chat.stop_strings, 1, text_options_for(reasoning, text_options))
    named = chat.tool_choice.function.name if isinstance(chat.tool_choice, schemas.NamedToolChoice) else None
    tools = tool_call_states(
        mode, named, settings.tool_call_parser, 1, structured.template_tools(chat), chat.parallel_tool_calls
    )
    run = _Run(req, gen, reasoning, tools[0] if tools else None)
    saved = items if req.store and store.is_enabled else None  # the input items kept with the response
    if req.stream:  # keep-alives, and the request released however the stream ends (streaming.py)
        return event_stream(gen, _events(run, store, saved), settings.sse_keepalive_s, done=False)
    text = await _gather_text(request, gen)
    if text is None:
        return Response(status_code=499)
    run.add_whole(text)
    final = run.response(done=True)
    if saved is not None:
        await store.save(final, saved)
    return JSONResponse(final)


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


class _Run:
    """One response as it is made: its text through the reasoning and tool-call parsers into output items."""

    def __init__(
        self, req: ResponsesRequest, gen: Generation, reasoning: ReasoningFormat | None, tools: ChoiceToolCalls | None
    ) -> None:
        self.req, self.gen, self.reasoning, self.tools = req, gen, reasoning, tools
        self.id = f"resp_{gen.request_id.rpartition('-')[2]}"
        self.created_at = int(time.time())
        self.output = OutputItems()
        self.splitter = new_splitter(reasoning) if reasoning is not None else None

    @property
    def is_truncated(self) -> bool:
        return self.gen.finish_reasons.get(0) == "length"

    def add(self, text: str, is_last: bool) -> list[Event]:
        """Streamed text: the events it makes (the last call closes the open item)."""
        thought = ""
        if self.splitter is not None:
            thought, text = self.splitter.feed(text)
            if is_last:
                more_thought, more_text = self.splitter.flush()
                thought, text = thought + more_thought, text + more_text
        calls: list[dict[str, Any]] = []
        if self.tools is not None and (text or is_last):  # (a named call's header waits for its first text)
            text, calls = self.tools.feed(text)
            if is_last:
                tail, more = self.tools.finish()
                text, calls = text + tail, calls + more
        events = self.output.reasoning(thought) + self.output.text(text)
        for call in calls:
            events += self.output.tool_call(call)
        return events + (self.output.close("incomplete" if self.is_truncated else "completed") if is_last else [])

    def add_whole(self, text: str) -> None:
        """A non-streamed answer: parsed whole, as chat's (an auto-mode call that is not valid JSON is text)."""
        thought, answer = split_reasoning(self.reasoning, text) if self.reasoning is not None else (None, text)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            self.tools.feed(answer or "")
            answer, calls = self.tools.message()
        self.output.reasoning(thought or "")
        self.output.text(answer or "")
        for call in calls:
            self.output.tool_call(call)
        self.output.close("incomplete" if self.is_truncated else "completed")

    def response(self, done: bool) -> dict[str, Any]:
        req = self.req
        status = "in_progress" if not done else "incomplete" if self.is_truncated else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.gen.served_model,
            "output": list(self.output.items) if done else [],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if done and self.is_truncated else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": (
                req.tool_choice.model_dump()
                if isinstance(req.tool_choice, NamedFunction)
                else req.tool_choice or "auto"
            ),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "truncation": req.truncation or "disabled",
            "store": req.store,
            "user": req.user,
            "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict[str, Any]:
        usage = self.gen.usage()
        choice = self.gen.choices[0]
        num_reasoning = (
            count_reasoning_tokens(self.reasoning, choice.tokenizer, choice.token_ids) if self.reasoning else 0
        )
        return {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            # cache_write_tokens: the SDK's type requires it; our prefix cache has no write to count
            "input_tokens_details": {
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens_details": {"reasoning_tokens": num_reasoning},
        }


async def _events(run: _Run, store: ResponseStore, saved: list[dict[str, Any]] | None) -> AsyncIterator[bytes]:
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        payload = orjson.dumps({"type": kind, "sequence_number": sequence - 1, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    yield event("response.created", response=run.response(done=False))
    yield event("response.in_progress", response=run.response(done=False))
    try:
        async for update in run.gen.updates():
            for kind, fields in run.add(update.text, is_last=update.finish_reason is not None):
                yield event(kind, **fields)
    except APIError as exc:  # the headers are out: the error goes in-band
        yield event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
        return
    final = run.response(done=True)
    if saved is not None:
        await store.save(final, saved)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
