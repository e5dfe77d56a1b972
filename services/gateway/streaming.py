"""Turning a Generation into an HTTP answer: SSE chunks while streaming, or one JSON body.

By the time these run the request was accepted (every check passed), so errors from here on are
in-band for a stream (`data: {"error": ...}` then `data: [DONE]`) and a plain error response
otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from services.gateway import responses
from services.gateway.batch import GenerationView, parts_of
from services.gateway.errors import APIError
from services.gateway.frontend import ChoiceUpdate, Generation
from services.gateway.tool_calls import ChoiceToolCalls, finish_reason

log = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 1.0


@dataclass(slots=True)
class StreamFormat:
    include_usage: bool = False  # a last chunk with usage and no choices
    continuous_usage: bool = False  # usage so far in every chunk too
    echoes: list[str] = field(default_factory=list)  # completions: per prompt, sent first in each of its choices
    echo_logprobs: int | None = None  # completions: echo with logprobs (the prompt tokens' ones)
    n: int = 1  # choices per prompt


def event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
        except APIError as exc:  # headers are out: the error goes in-band, then [DONE]
            yield responses.sse(exc.body())
        except Exception:
            log.exception("a stream failed")
            yield responses.sse(APIError(500, "internal server error", type="internal_server_error").body())
        yield responses.sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _with_usage(gen: GenerationView, chunk: dict[str, Any], fmt: StreamFormat) -> dict[str, Any]:
    if not fmt.include_usage:
        return chunk
    return {**chunk, "usage": gen.usage() if fmt.continuous_usage else None}


async def chat_events(
    gen: Generation, fmt: StreamFormat, tools: list[ChoiceToolCalls] | None = None,
) -> AsyncIterator[bytes]:
    seen: set[int] = set()  # choices whose first chunk (with the role) went out
    async for update in gen.updates():
        is_first = update.index not in seen
        calls: list[Any] = []
        if tools is not None:  # text becomes content and tool-call deltas
            update, calls = _tool_update(tools[update.index], update)
        if update.text or update.finish_reason or update.logprobs or is_first or calls:
            seen.add(update.index)
            chunk = responses.chat_chunk(gen, update, is_first)
            if calls:
                chunk["choices"][0]["delta"]["tool_calls"] = calls
                if not update.text:
                    chunk["choices"][0]["delta"]["content"] = None
            yield responses.sse(_with_usage(gen, chunk, fmt))
    if fmt.include_usage:
        yield responses.sse(responses.usage_chunk(gen, "chat.completion.chunk"))


def _tool_update(state: ChoiceToolCalls, update: ChoiceUpdate) -> tuple[ChoiceUpdate, list[Any]]:
    content, calls = state.feed(update.text)
    if update.finish_reason is not None:
        tail, more = state.finish()
        content, calls = content + tail, calls + more
    return replace(update, text=content, finish_reason=finish_reason(state, update.finish_reason)), calls


async def completion_events(gen: GenerationView, fmt: StreamFormat) -> AsyncIterator[bytes]:
    n = fmt.n
    offsets = [len(fmt.echoes[i // n]) if fmt.echoes else 0 for i in range(len(gen.choices))]  # next text_offset
    unechoed = set(range(len(gen.choices))) if fmt.echoes else set()
    async for update in gen.updates():
        if update.index in unechoed:  # sent with the first update: the prompt logprobs come with it
            unechoed.discard(update.index)
            logprobs = None
            if fmt.echo_logprobs is not None:
                part = parts_of(gen)[update.index // n]
                logprobs = responses.echo_logprobs(gen.token_texts, part, fmt.echo_logprobs)
            choice = {"index": update.index, "text": fmt.echoes[update.index // n], "logprobs": logprobs,
                      "finish_reason": None}
            yield responses.sse(_with_usage(gen, responses.envelope(gen, "text_completion", [choice]), fmt))
        if update.text or update.finish_reason or update.logprobs:
            chunk = responses.completion_chunk(gen, update, offsets[update.index])
            offsets[update.index] += len(update.text)
            yield responses.sse(_with_usage(gen, chunk, fmt))
    if fmt.include_usage:
        yield responses.sse(responses.usage_chunk(gen, "text_completion"))


async def collect(
    request: Request, gen: GenerationView, is_chat: bool, prefix: str | list[str] = "",
    tools: list[ChoiceToolCalls] | None = None,
    finish: Callable[[dict[str, Any]], None] | None = None,  # adds to the body (prompt logprobs)
) -> Response:
    """Gather a whole answer, aborting the request if the client goes away meanwhile."""
    texts = list(prefix) if isinstance(prefix, list) else [prefix] * len(gen.choices)
    logprobs: list[Any] = [None] * len(gen.choices)

    async def gather() -> None:
        async for u in gen.updates():
            if is_chat:
                part = responses.chat_logprobs(gen.token_texts, u)
            else:
                part = responses.completion_logprobs(gen.token_texts, u, len(texts[u.index]))
            logprobs[u.index] = responses.merge_logprobs(logprobs[u.index], part)
            texts[u.index] += u.text

    task = asyncio.create_task(gather())
    while not task.done():
        await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # updates() ends in its `finally`: the engine gets an Abort
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
    task.result()  # re-raises an APIError from the generation
    builder = responses.chat_response if is_chat else responses.completion_response
    body = builder(gen, texts, logprobs)
    if tools is not None:
        for choice, state, text in zip(body["choices"], tools, texts):
            state.feed(text)
            content, calls = state.message()
            if calls:
                choice["message"].update(content=content, tool_calls=calls)
                choice["finish_reason"] = finish_reason(state, choice["finish_reason"])
    if finish is not None:
        finish(body)
    return JSONResponse(body)
