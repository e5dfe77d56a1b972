"""/v1/completions: one prompt or a batch, echo, and prompt logprobs, streaming or not.

prompt(s) ─► one wire request per prompt ─► Generation (one) | BatchGeneration (several)
echo: each choice starts with its prompt; with `logprobs` the prompt tokens get logprobs too
      (the first one null); they arrive with the first generated token
prompt_logprobs (vLLM's): per choice, [null, {token_id: {logprob, rank, decoded_token}}, ...]
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedserve.services.gateway import beam_response, responses, schemas, streaming
from pagedserve.services.gateway.batch import BatchGeneration, parts_of, submit_batch
from pagedserve.services.gateway.frontend import Frontend, Generation
from pagedserve.services.gateway.wire_request import to_wire
from pagedserve.shared.config import GatewayConfig


async def serve(
    request: Request, req: schemas.CompletionRequest, frontend: Frontend, settings: GatewayConfig
) -> Response:
    request_id = frontend.new_request_id("cmpl")
    prompts = req.prompts
    traceparent = request.headers.get("traceparent")
    wires = [
        to_wire(req, request_id if len(prompts) == 1 else f"{request_id}-{i}", settings.gateway_id, traceparent, prompt)
        for i, prompt in enumerate(prompts)
    ]
    if req.use_beam_search:
        beam_response.check(req)
        response_id = f"cmpl-{req.request_id}" if req.request_id is not None else request_id
        return await beam_response.respond(req, wires, frontend, response_id, prompts if req.echo else None)
    gen: Generation | BatchGeneration
    if len(wires) == 1:
        gen = await frontend.submit(wires[0], req.stop_strings, req.num_choices, req.text_options)
    else:
        gen = await submit_batch(frontend, wires, req.stop_strings, req.num_choices, request_id, req.text_options)
    if req.request_id is not None:  # the id the client chose names the response; ours stays unique inside
        gen.response_id = f"cmpl-{req.request_id}"
    echoes = [_echo_text(part, prompt) for part, prompt in zip(parts_of(gen), prompts)] if req.echo else []
    if req.is_stream:
        fmt = streaming.StreamFormat(
            req.include_usage,
            req.continuous_usage,
            echoes,
            req.logprobs if req.echo else None,
            req.num_choices,
            return_token_ids=req.return_token_ids,
        )
        return streaming.event_stream(gen, streaming.completion_events(gen, fmt), settings.sse_keepalive_s)
    prefixes = [echo for echo in echoes for _ in range(req.num_choices)] if echoes else ""
    return await streaming.collect(
        request, gen, is_chat=False, prefix=prefixes, finish=lambda body: _add_prompt_logprobs(body, gen, req)
    )


def _add_prompt_logprobs(
    body: dict[str, Any], gen: Generation | BatchGeneration, req: schemas.CompletionRequest
) -> None:
    echo_k = req.logprobs if req.echo else None
    parts = parts_of(gen)
    for choice in body["choices"]:
        part = parts[choice["index"] // req.num_choices]
        if req.return_token_ids:  # vLLM's: saves RL and eval frameworks a retokenization
            choice["prompt_token_ids"] = list(part.accepted.prompt_token_ids)
            choice["token_ids"] = list(part.choices[choice["index"] % req.num_choices].token_ids)
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
