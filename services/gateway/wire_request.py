"""The one place an API request becomes the message the tokenizer service takes, for HTTP and gRPC alike.

Both front doors validate into the same pydantic request models (schemas.py); this turns one of them
into a ChatRequest or CompletionRequest with everything the later services need: sampling, the token
budget, the trace parent, and for chat the template's extra variables and tools.
"""

from __future__ import annotations

import time
from typing import Any, overload

from pagedserve.services.gateway import schemas, structured
from pagedserve.shared.protocol import ChatRequest, CompletionRequest

APIRequest = schemas.ChatCompletionRequest | schemas.CompletionRequest


@overload
def to_wire(
    req: schemas.ChatCompletionRequest,
    request_id: str,
    reply_to: str,
    traceparent: str | None = None,
    prompt: None = None,
) -> ChatRequest: ...
@overload
def to_wire(
    req: schemas.CompletionRequest,
    request_id: str,
    reply_to: str,
    traceparent: str | None = None,
    prompt: str | list[int] | None = None,
) -> CompletionRequest: ...
@overload
def to_wire(
    req: APIRequest,
    request_id: str,
    reply_to: str,
    traceparent: str | None = None,
    prompt: str | list[int] | None = None,
) -> ChatRequest | CompletionRequest: ...


def to_wire(
    req: APIRequest,
    request_id: str,
    reply_to: str,
    traceparent: str | None = None,
    prompt: str | list[int] | None = None,
) -> ChatRequest | CompletionRequest:
    """`prompt`: which of a completion request's prompts (default its first); chat requests have none."""
    common: dict[str, Any] = dict(
        request_id=request_id,
        reply_to=reply_to,
        model=req.model,
        sampling=schemas.sampling_dict(req),
        max_tokens=req.token_budget,
        stream=req.is_stream,
        arrival_time=time.time(),
        traceparent=traceparent,
    )
    if isinstance(req, schemas.ChatCompletionRequest):
        return ChatRequest(
            messages=[m.as_template_input() for m in req.messages],
            chat_template_kwargs=_template_kwargs(req),
            tools=structured.template_tools(req),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            documents=req.documents,
            **common,
        )
    return CompletionRequest(prompt=req.prompts[0] if prompt is None else prompt, **common)


def _template_kwargs(req: schemas.ChatCompletionRequest) -> dict[str, Any]:
    """The template's extra variables: chat_template_kwargs, and OpenAI's reasoning_effort, which templates
    such as gpt-oss's read (one that does not ignores it). An explicit chat_template_kwargs entry wins."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs
