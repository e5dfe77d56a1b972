"""The HTTP answer of a beam-search request (chat or completions; one prompt or a batch).

The search runs to the end before anything is sent, so its errors are plain error responses, streamed or
not; a stream then carries each choice whole (a content chunk and a finish chunk), usage if asked, [DONE].
Choices are per prompt, best beam first; with logprobs, each token's entry is the one the beam was scored by.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.services.gateway import beam_search, responses, schemas, structured
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.shared.protocol import ChatRequest, CompletionRequest

APIRequest = schemas.ChatCompletionRequest | schemas.CompletionRequest


def check(req: APIRequest) -> None:
    """400s a beam-search request gets before anything is sent."""
    width = req.beam_width
    if width > beam_search.MAX_WIDTH:
        raise APIError(400, f"beam search takes at most {beam_search.MAX_WIDTH} beams (n, best_of)", param="n")
    if structured.grammar_spec(req) is not None:
        raise APIError(400, "beam search cannot be combined with structured output", param="use_beam_search")
    if isinstance(req, schemas.ChatCompletionRequest) and req.tools and req.tool_choice != "none":
        raise APIError(400, "beam search cannot be combined with tool calling", param="use_beam_search")


async def respond(
    req: APIRequest,
    wires: list[ChatRequest] | list[CompletionRequest],
    frontend: Frontend,
    response_id: str,
    echoes: list[str] | list[str | list[int]] | None = None,
) -> Response:
    """`echoes`: per prompt, what the text starts with (chat: the continued message; completions: the prompt,
    token ids decoded with their special tokens)."""
    is_chat = isinstance(req, schemas.ChatCompletionRequest)
    k = req.num_logprobs
    results = await asyncio.gather(
        *(beam_search.search(frontend, wire, req.beam_width, req.length_penalty, k) for wire in wires)
    )
    opts = req.text_options
    per_prompt = [
        beam_search.choices_of(
            r, req.num_choices, req.stop_strings, req.length_penalty, opts.skip_special_tokens, opts.include_stop_str
        )
        for r in results
    ]
    head = {
        "id": response_id,
        "created": int(time.time()),
        "model": req.model,
        "system_fingerprint": responses.SYSTEM_FINGERPRINT,
    }
    completion = sum(len(c.token_ids) for choices in per_prompt for c in choices)
    prompt = sum(r.num_prompt_tokens for r in results)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    choices: list[dict[str, Any]] = []
    for p, (result, beams) in enumerate(zip(results, per_prompt)):
        for beam in beams:
            index = len(choices)
            echo = echoes[p] if echoes else ""
            text = (echo if isinstance(echo, str) else str(result.tokenizer.decode(echo))) + beam.text
            choice: dict[str, Any] = {"index": index}
            if is_chat:
                choice["message"] = {"role": "assistant", "content": text, "refusal": None}
                choice["logprobs"] = responses.chat_logprobs(result.token_texts, beam.update) if k is not None else None
            else:
                choice["text"] = text
                logprobs = responses.completion_logprobs(result.token_texts, beam.update, 0) if k is not None else None
                choice["logprobs"] = logprobs
            choice.update(finish_reason=beam.finish_reason, stop_reason=beam.stop_reason)
            if req.return_token_ids:  # chat: the prompt's ids at the top, as without beam search
                choice["token_ids"] = beam.token_ids
                if not is_chat:
                    choice["prompt_token_ids"] = result.prompt_token_ids
            choices.append(choice)
    if not req.is_stream:
        obj = "chat.completion" if is_chat else "text_completion"
        body = {**head, "object": obj, "choices": choices, "usage": usage}
        if is_chat:
            body["prompt_logprobs"] = None
            if req.return_token_ids:
                body["prompt_token_ids"] = results[0].prompt_token_ids
        else:
            for choice in choices:
                choice["prompt_logprobs"] = None
        return JSONResponse(body)
    include_usage = req.include_usage
    return StreamingResponse(
        _events(head, choices, usage if include_usage else None, is_chat),
        media_type="text/event-stream",
        headers={"cache-control": "no-cache"},
    )


async def _events(
    head: dict[str, Any], choices: list[dict[str, Any]], usage: dict[str, Any] | None, is_chat: bool
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if is_chat else "text_completion"
    for choice in choices:
        if is_chat:
            message = choice["message"]
            content = {"role": "assistant", "content": message["content"]}
            end: dict[str, Any] = {"content": ""}
            first = {"index": choice["index"], "delta": content, "logprobs": choice["logprobs"], "finish_reason": None}
            last = {"index": choice["index"], "delta": end, "logprobs": None}
        else:
            first = {"index": choice["index"], "text": choice["text"], "logprobs": choice["logprobs"]}
            first["finish_reason"] = None
            last = {"index": choice["index"], "text": "", "logprobs": None}
        last.update(finish_reason=choice["finish_reason"], stop_reason=choice["stop_reason"])
        if "token_ids" in choice:
            first["token_ids"] = choice["token_ids"]
            if "prompt_token_ids" in choice:
                first["prompt_token_ids"] = choice["prompt_token_ids"]
        for part in (first, last):
            yield responses.sse({**head, "object": obj, "choices": [part], **({"usage": None} if usage else {})})
    if usage is not None:
        yield responses.sse({**head, "object": obj, "choices": [], "usage": usage})
    yield responses.sse("[DONE]")
