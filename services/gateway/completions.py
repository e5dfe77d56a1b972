"""/v1/completions: one prompt or a batch, echo, and prompt logprobs, streaming or not.

    prompt(s) ─► one wire request per prompt ─► Generation (one) | BatchGeneration (several)
    echo: each choice starts with its prompt; with `logprobs` the prompt tokens get logprobs too
          (the first one null); they arrive with the first generated token
    prompt_logprobs (vLLM's): per choice, [null, {token_id: {logprob, rank, decoded_token}}, ...]
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from services.gateway import responses, schemas, streaming
from services.gateway.batch import BatchGeneration, parts_of, submit_batch
from services.gateway.frontend import Frontend, Generation
from shared.protocol import CompletionRequest
from shared.settings import GatewaySettings


async def serve(request: Request, req: schemas.CompletionRequest, frontend: Frontend,
                settings: GatewaySettings) -> Response:  # fmt: skip
    request_id = frontend.new_request_id("cmpl")
    prompts = req.prompts
    wires = [
        CompletionRequest(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}", reply_to=settings.gateway_id,
            model=req.model, prompt=prompt, sampling=schemas.sampling_dict(req), max_tokens=req.token_budget,
            stream=req.is_stream, arrival_time=time.time(), traceparent=request.headers.get("traceparent"),
        )
        for i, prompt in enumerate(prompts)
    ]
    gen: Generation | BatchGeneration
    if len(wires) == 1:
        gen = await frontend.submit(wires[0], req.stop_strings, req.num_choices)
    else:
        gen = await submit_batch(frontend, wires, req.stop_strings, req.num_choices, request_id)
    echoes = [_echo_text(part, prompt) for part, prompt in zip(parts_of(gen), prompts)] if req.echo else []
    if req.is_stream:
        fmt = streaming.StreamFormat(req.include_usage, req.continuous_usage, echoes,
                                     req.logprobs if req.echo else None, req.num_choices)  # fmt: skip
        return streaming.event_stream(streaming.completion_events(gen, fmt))
    prefixes = [echo for echo in echoes for _ in range(req.num_choices)] if echoes else ""
    return await streaming.collect(request, gen, is_chat=False, prefix=prefixes,
                                   finish=lambda body: _add_prompt_logprobs(body, gen, req))  # fmt: skip


def _add_prompt_logprobs(body: dict[str, Any], gen: Generation | BatchGeneration,
                         req: schemas.CompletionRequest) -> None:  # fmt: skip
    echo_k = req.logprobs if req.echo else None
    if echo_k is None and req.prompt_logprobs is None:
        return
    parts = parts_of(gen)
    for choice in body["choices"]:
        part = parts[choice["index"] // req.num_choices]
        if echo_k is not None:
            echoed = responses.echo_logprobs(gen.token_texts, part, echo_k)
            choice["logprobs"] = responses.merge_logprobs(echoed, choice["logprobs"])
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = responses.vllm_prompt_logprobs(gen.token_texts, part, req.prompt_logprobs)


def _echo_text(gen: Generation, prompt: str | list[int]) -> str:
    """The prompt as the client sent it (token ids are decoded, special tokens included)."""
    if isinstance(prompt, str):
        return prompt
    return str(gen.choices[0].tokenizer.decode(prompt))
