"""/v1/embeddings: OpenAI's request and response, over the ordinary request path.

    input (a string, token ids, or a batch of either) ─► one pooling request per input ─► tokenizer
    (length and `dimensions` checks) ─► the model's embedding engines ─► one vector per input, in order

Each input runs as its own request (batch.submit_batch: all accepted or none kept), so a batch spreads
over replicas and batches with other traffic in the engines. `encoding_format: base64` is the vector's
little-endian float32 bytes, which the openai client decodes; `usage` counts the inputs' tokens. A model
whose engines generate text answers 400 naming `model` (frontend.check_runner).
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.services.gateway.batch import BatchGeneration, parts_of, submit_batch
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Frontend, Generation
from pagedserve.services.gateway.messages import Strict
from pagedserve.services.gateway.schemas import MAX_INT32
from pagedserve.shared.config import GatewayConfig
from pagedserve.shared.protocol import CompletionRequest, Sampling


class EmbeddingRequest(Strict):
    model: str = Field(min_length=1)
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=MAX_INT32)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=MAX_INT32)  # vLLM's: keep k input tokens
    truncation_side: Literal["left", "right"] = "left"  # which end truncate_prompt_tokens cuts

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: str | list[Any]) -> str | list[Any]:
        """A string, token ids, or a batch of either; nothing empty."""
        if isinstance(value, str):
            if not value:
                raise ValueError("the input is empty")
            return value
        if not value:
            raise ValueError("the input is empty")
        if all(isinstance(v, str) for v in value):
            if not all(value):
                raise ValueError("an input in the batch is empty")
            return value
        if all(isinstance(v, list) for v in value):
            return [_token_ids(v) for v in value]
        if any(isinstance(v, str | list) for v in value):
            raise ValueError("a batch must be all strings or all token-id lists")
        return _token_ids(value)

    @property
    def inputs(self) -> list[str | list[int]]:
        """The batch's inputs, or the one input."""
        if isinstance(self.input, str) or all(type(v) is int for v in self.input):
            return [self.input]
        return list(self.input)

    @property
    def is_stream(self) -> bool:  # what the gateway's request log line reads
        return False

    @property
    def token_budget(self) -> int | None:
        return None


def _token_ids(value: list[Any]) -> list[int]:
    if not value:
        raise ValueError("a token-id input is empty")
    if not all(type(v) is int and 0 <= v <= MAX_INT32 for v in value):
        raise ValueError("a token-id input must be a list of non-negative integers")
    return value


async def serve(request: Request, req: EmbeddingRequest, frontend: Frontend, settings: GatewayConfig) -> Response:
    inputs = req.inputs
    if len(inputs) > settings.max_prompts:
        raise APIError(400, f"a batch may have at most {settings.max_prompts} inputs", param="input")
    request_id = frontend.new_request_id("embd")
    traceparent = request.headers.get("traceparent")
    wires = [
        CompletionRequest(
            request_id=request_id if len(inputs) == 1 else f"{request_id}-{i}",
            reply_to=settings.gateway_id,
            model=req.model,
            prompt=text,
            arrival_time=time.time(),
            traceparent=traceparent,
            sampling=_truncation(req),
            pooling={"dimensions": req.dimensions},
        )
        for i, text in enumerate(inputs)
    ]
    gen: Generation | BatchGeneration
    if len(wires) == 1:
        gen = await frontend.submit(wires[0], [], 1)
    else:
        gen = await submit_batch(frontend, wires, [], 1, request_id)
    async for _ in gen.updates():  # until every input's engine request finished (an error raises)
        pass
    data = [
        {"object": "embedding", "index": index, "embedding": _encoded(_vector(part), req.encoding_format)}
        for index, part in enumerate(parts_of(gen))
    ]
    num_tokens = sum(part.accepted.num_prompt_tokens for part in parts_of(gen))
    body = {
        "id": request_id,
        "object": "list",
        "created": gen.created,
        "model": req.model,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
    return JSONResponse(body)


def _truncation(req: EmbeddingRequest) -> Sampling:
    """vLLM's truncate_prompt_tokens, applied by the tokenizer service as for completions."""
    if req.truncate_prompt_tokens is None:
        return Sampling()
    return Sampling(truncate_prompt_tokens=req.truncate_prompt_tokens, truncation_side=req.truncation_side)


def _vector(part: Generation) -> list[float]:
    if part.embedding is None:  # an engine ended it without one: a bug, not the client's fault
        raise APIError(500, "the engine returned no embedding", type="internal_server_error")
    return part.embedding


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # what the openai client decodes: little-endian float32
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
