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
from starlette.types import Receive, Scope, Send

from pagedserve.services.gateway import responses
from pagedserve.services.gateway.batch import GenerationView, parts_of
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import ChoiceUpdate, Generation
from pagedserve.services.gateway.reasoning import (
    ReasoningFormat,
    Splitter,
    add_reasoning_tokens,
    new_splitter,
    split_reasoning,
)
from pagedserve.services.gateway.tool_calls import ChoiceToolCalls, finish_reason

log = logging.getLogger(__name__)
_DISCONNECT_POLL_S = 1.0


@dataclass(slots=True)
class StreamFormat:
    include_usage: bool = False  # a last chunk with usage and no choices
    continuous_usage: bool = False  # usage so far in every chunk too
    echoes: list[str] = field(default_factory=list)  # completions: per prompt, sent first in each of its choices
    echo_logprobs: int | None = None  # completions: echo with logprobs (the prompt tokens' ones)
    n: int = 1  # choices per prompt
    reasoning: ReasoningFormat | None = None  # chat: --reasoning-parser's split into reasoning_content
    legacy_functions: bool = False  # chat: answer tool calls as OpenAI's legacy delta.function_call
    return_token_ids: bool = False  # vLLM's: each chunk's token ids, the prompt's with a choice's first chunk


KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see a live stream


class _EventStreamResponse(StreamingResponse):
    """A stream whose generation is released however the response ends, even when the client left before
    the body was first iterated (the body's own `finally` then never runs)."""

    def __init__(self, content: AsyncIterator[bytes], gen: GenerationView) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for part in parts_of(self.gen):  # a no-op for a generation that already ended
                part.frontend.release(part)


def event_stream(
    gen: GenerationView, events: AsyncIterator[bytes], keepalive_s: float, done: bool = True
) -> StreamingResponse:
    """The SSE response: `events` with keep-alives, an in-band error if the generation fails after the
    headers, then `data: [DONE]` (unless `done` is False: the Responses API ends with its own event)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in with_keepalives(events, keepalive_s):
                yield event
        except APIError as exc:  # headers are out: the error goes in-band, then [DONE]
            yield responses.sse(exc.body())
        except Exception:
            log.exception("a stream failed")
            yield responses.sse(APIError(500, "internal server error", type="internal_server_error").body())
        if done:
            yield responses.sse("[DONE]")

    return _EventStreamResponse(body(), gen)


async def with_keepalives(events: AsyncIterator[bytes], interval_s: float) -> AsyncIterator[bytes]:
    """`events`, with KEEP_ALIVE whenever none came for `interval_s` (a queued request, a slow engine, text
    a tool-call parser holds back). A pump task reads `events`, so waiting for the next one never cancels
    it; closing this generator cancels the pump, which ends `events` (and so aborts the request). One timer
    per stream checks for silence, so an event costs no timeout of its own (this is the hot path)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[bytes | None, BaseException | None]] = asyncio.Queue()
    last_sent = loop.time()
    timer: asyncio.TimerHandle | None = None

    async def pump() -> None:
        try:
            async for event in events:
                queue.put_nowait((event, None))
        except Exception as exc:  # re-raised in the reader, so event_stream sends it in-band
            queue.put_nowait((None, exc))
            return
        queue.put_nowait((None, None))

    def check_silence() -> None:
        nonlocal timer
        if loop.time() - last_sent >= interval_s:
            queue.put_nowait((KEEP_ALIVE, None))
            timer = loop.call_later(interval_s, check_silence)
        else:
            timer = loop.call_at(last_sent + interval_s, check_silence)

    task = asyncio.create_task(pump())
    timer = loop.call_later(interval_s, check_silence)
    try:
        while True:
            event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                return
            last_sent = loop.time()
            yield event
    finally:
        if timer is not None:
            timer.cancel()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _with_usage(gen: GenerationView, chunk: dict[str, Any], fmt: StreamFormat) -> dict[str, Any]:
    if not fmt.include_usage:
        return chunk
    return {**chunk, "usage": gen.usage() if fmt.continuous_usage else None}


async def chat_events(
    gen: Generation,
    fmt: StreamFormat,
    tools: list[ChoiceToolCalls] | None = None,
) -> AsyncIterator[bytes]:
    seen: set[int] = set()  # choices whose first chunk (with the role) went out
    splitters = [new_splitter(fmt.reasoning) for _ in gen.choices] if fmt.reasoning else None
    async for update in gen.updates():
        is_first = update.index not in seen
        calls: list[Any] = []
        thought = ""
        if splitters is not None:  # reasoning first: only the answer may hold tool calls
            update, thought = _reasoning_update(splitters[update.index], update)
        if tools is not None:  # text becomes content and tool-call deltas
            update, calls = _tool_update(tools[update.index], update)
        has_ids = fmt.return_token_ids and bool(update.token_ids)  # ids held back as text still go out
        if update.text or update.finish_reason or update.logprobs or is_first or calls or thought or has_ids:
            seen.add(update.index)
            chunk = responses.chat_chunk(gen, update, is_first)
            delta = chunk["choices"][0]["delta"]
            if thought:
                delta["reasoning_content"] = thought
            if calls and fmt.legacy_functions:
                legacy = responses.legacy_function_delta(calls)
                if legacy is not None:
                    delta["function_call"] = legacy
            elif calls:
                delta["tool_calls"] = calls
            if (calls or thought) and not update.text:
                delta["content"] = None
            if is_first and fmt.echoes:  # vLLM's chat echo: the continued message comes first
                delta["content"] = fmt.echoes[0] + (delta.get("content") or "")
            if fmt.legacy_functions:
                chunk["choices"][0]["finish_reason"] = responses.legacy_finish_reason(update.finish_reason)
            if fmt.return_token_ids:
                chunk["choices"][0]["token_ids"] = list(update.token_ids)
                if is_first:
                    chunk["prompt_token_ids"] = list(gen.accepted.prompt_token_ids)
            yield responses.sse(_with_usage(gen, chunk, fmt))
    if fmt.include_usage:
        last = responses.usage_chunk(gen, "chat.completion.chunk")
        if fmt.reasoning is not None:
            add_reasoning_tokens(last["usage"], fmt.reasoning, gen.choices)
        yield responses.sse(last)


def _reasoning_update(splitter: Splitter, update: ChoiceUpdate) -> tuple[ChoiceUpdate, str]:
    """The update with only its answer text, and the reasoning text it carried."""
    thought, content = splitter.feed(update.text)
    if update.finish_reason is not None:
        more_thought, more_content = splitter.flush()
        thought, content = thought + more_thought, content + more_content
    return replace(update, text=content), thought


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
    ids_sent: set[int] = set()  # choices whose prompt token ids went out
    async for update in gen.updates():
        if update.index in unechoed:  # sent with the first update: the prompt logprobs come with it
            unechoed.discard(update.index)
            logprobs = None
            if fmt.echo_logprobs is not None:
                part = parts_of(gen)[update.index // n]
                logprobs = responses.echo_logprobs(gen.token_texts, part, fmt.echo_logprobs)
            choice = {
                "index": update.index,
                "text": fmt.echoes[update.index // n],
                "logprobs": logprobs,
                "finish_reason": None,
            }
            yield responses.sse(_with_usage(gen, responses.envelope(gen, "text_completion", [choice]), fmt))
        if update.text or update.finish_reason or update.logprobs or (fmt.return_token_ids and update.token_ids):
            chunk = responses.completion_chunk(gen, update, offsets[update.index])
            offsets[update.index] += len(update.text)
            if fmt.return_token_ids:
                chunk["choices"][0]["token_ids"] = list(update.token_ids)
                if update.index not in ids_sent:
                    ids_sent.add(update.index)
                    part = parts_of(gen)[update.index // n]
                    chunk["choices"][0]["prompt_token_ids"] = list(part.accepted.prompt_token_ids)
            yield responses.sse(_with_usage(gen, chunk, fmt))
    if fmt.include_usage:
        yield responses.sse(responses.usage_chunk(gen, "text_completion"))


async def collect(
    request: Request,
    gen: GenerationView,
    is_chat: bool,
    prefix: str | list[str] = "",
    tools: list[ChoiceToolCalls] | None = None,
    finish: Callable[[dict[str, Any]], None] | None = None,  # adds to the body (prompt logprobs)
    reasoning: ReasoningFormat | None = None,  # chat: --reasoning-parser
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
    thoughts: list[str | None] = [None] * len(texts)
    if reasoning is not None:  # the answer is what follows the reasoning; tool calls live in the answer
        for i, text in enumerate(texts):
            thoughts[i], answer = split_reasoning(reasoning, text)
            texts[i] = answer or ""
    builder = responses.chat_response if is_chat else responses.completion_response
    body = builder(gen, texts, logprobs)
    if reasoning is not None:
        add_reasoning_tokens(body["usage"], reasoning, gen.choices)
        for choice, thought, text in zip(body["choices"], thoughts, texts):
            choice["message"]["reasoning_content"] = thought
            choice["message"]["content"] = text or None
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
