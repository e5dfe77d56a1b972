"""`POST /tokenize` and `POST /detokenize` (vLLM's helper routes and bodies).

    {"model", "prompt", "add_special_tokens"?}           -> {"count", "max_model_len", "tokens", "token_strs"}
    {"model", "messages", "add_generation_prompt"?, ...}  -> the same, for the chat template's ids
    {"model", "tokens"}                                   -> {"prompt"}

Chat tokenization calls the tokenizer service's own function, so the ids are exactly those a
chat request would get.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.messages import ChatMessage, Strict
from pagedserve.services.gateway.schemas import TokenId
from pagedserve.services.gateway.validation import read_json, validate
from pagedserve.shared.prompts import chat_prompt_ids, check_template_kwargs, first_out_of_vocab, text_prompt_ids

log = logging.getLogger(__name__)


class TokenizeText(Strict):
    model: str = Field(min_length=1)
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(Strict):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class Detokenize(Strict):
    model: str = Field(min_length=1)
    tokens: list[TokenId]


async def tokenize(request: Request) -> Response:
    frontend: Frontend = request.app.state.frontend
    body = await read_json(request, frontend.settings.max_body_bytes)
    req: TokenizeChat | TokenizeText
    if isinstance(body, dict) and "messages" in body:
        req = validate(TokenizeChat, body)
    else:
        req = validate(TokenizeText, body)
    tokenizer, max_model_len = await frontend.tokenizer_of(req.model)
    if isinstance(req, TokenizeChat):
        if len(req.messages) > frontend.settings.max_messages:
            raise APIError(400, f"at most {frontend.settings.max_messages} messages are allowed", param="messages")
        template_kwargs = req.chat_template_kwargs or {}
        try:
            check_template_kwargs(template_kwargs, tokenizer)
        except ValueError as exc:
            raise APIError(400, str(exc), param="chat_template_kwargs") from None
        messages = [m.as_template_input() for m in req.messages]
        try:
            ids = await asyncio.to_thread(
                chat_prompt_ids, tokenizer, messages, template_kwargs, req.add_generation_prompt
            )
        except Exception as exc:  # template errors come from user content; the detail is logged, not sent
            log.info("the chat template failed on a /tokenize request: %r", exc)
            raise APIError(
                400, "could not build the prompt from these messages with the model's chat template", param="messages"
            ) from None
    else:
        ids = await asyncio.to_thread(text_prompt_ids, tokenizer, req.prompt, req.add_special_tokens)
    token_strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs})


async def detokenize(request: Request) -> Response:
    frontend: Frontend = request.app.state.frontend
    req = validate(Detokenize, await read_json(request, frontend.settings.max_body_bytes))
    tokenizer, _ = await frontend.tokenizer_of(req.model)
    vocab = len(tokenizer)
    bad = first_out_of_vocab(req.tokens, vocab)
    if bad is not None:
        raise APIError(400, f"token id {bad} is not in [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)})
