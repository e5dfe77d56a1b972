"""Between the gRPC messages and the HTTP API's objects: requests become the same pydantic request
models (so validation, caps and defaults are HTTP's), APIErrors become gRPC status codes, and choice
updates become GenerateResponse messages."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import json_format

from pagedserve.services.gateway import schemas, wire_request
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import ChoiceUpdate
from pagedserve.services.gateway.grpc_api import pagedserve_pb2 as pb
from pagedserve.services.gateway.token_text import TokenTexts
from pagedserve.services.gateway.validation import validate
from pagedserve.shared.config import GatewayConfig
from pagedserve.shared.protocol import ChatRequest, CompletionRequest

WireRequest = ChatRequest | CompletionRequest

_OPTIONAL_SAMPLING = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
)
ABORTED = 499  # an Abort call ended the request (nginx's "client closed request")
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ABORTED: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}

Validated = schemas.ChatCompletionRequest | schemas.CompletionRequest


def to_api_request(request: pb.GenerateRequest, settings: GatewayConfig) -> Validated:
    """The HTTP request this gRPC request stands for, validated and checked against the caps."""
    sampling = request.sampling
    body: dict[str, Any] = {"model": request.model, "stream": True}
    body.update({name: getattr(sampling, name) for name in _OPTIONAL_SAMPLING if sampling.HasField(name)})
    if sampling.stop:
        body["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.logit_bias:
        body["logit_bias"] = dict(sampling.logit_bias)
    kind = request.WhichOneof("input")
    cls: type[Validated]
    if kind == "chat":
        cls = schemas.ChatCompletionRequest
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if request.chat.HasField("chat_template_kwargs"):
            body["chat_template_kwargs"] = json_format.MessageToDict(request.chat.chat_template_kwargs)
        if request.chat.tools:
            body["tools"] = [json_format.MessageToDict(tool) for tool in request.chat.tools]
        if sampling.HasField("logprobs"):
            body.update(logprobs=True, top_logprobs=sampling.logprobs)
    elif kind in ("prompt", "prompt_token_ids"):
        cls = schemas.CompletionRequest
        body["prompt"] = request.prompt if kind == "prompt" else list(request.prompt_token_ids.ids)
        if sampling.HasField("logprobs"):
            body["logprobs"] = sampling.logprobs
    else:
        raise APIError(400, "one of prompt, prompt_token_ids or chat is required", param="input")
    req = validate(cls, body)
    schemas.check_limits(req, settings)
    if isinstance(req, schemas.CompletionRequest) and len(req.prompts) != 1:
        raise APIError(400, "one prompt per Generate call", param="prompt")
    return req


def to_wire(req: Validated, request_id: str, settings: GatewayConfig, traceparent: str | None) -> WireRequest:
    """The message the tokenizer service takes, built as the HTTP routes build it (always streamed here)."""
    return wire_request.to_wire(req.model_copy(update={"stream": True}), request_id, settings.gateway_id, traceparent)


def status_of(exc: APIError) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an API error; the message names the parameter, as HTTP's `param` does."""
    code = _STATUS_CODES.get(exc.status, grpc.StatusCode.INTERNAL)
    return code, exc.message if exc.param is None else f"{exc.message} (param: {exc.param})"


def to_response(request_id: str, update: ChoiceUpdate, texts: TokenTexts) -> pb.GenerateResponse:
    logprobs = [
        pb.TokenLogprob(
            token_id=token_id,
            logprob=logprob,
            token=texts.text(token_id),
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=v, token=texts.text(t)) for t, v in top],
        )
        for token_id, (logprob, top) in zip(update.token_ids, update.logprobs or [])
    ]
    return pb.GenerateResponse(
        request_id=request_id,
        index=update.index,
        text=update.text,
        token_ids=update.token_ids,
        logprobs=logprobs,
        finish_reason=update.finish_reason or "",
    )


def to_usage(usage: dict[str, Any]) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )
