"""OpenAI response bodies and stream chunks for chat and text completions.

Logprobs arrive per token as `[logprob, [[token_id, logprob], ...top alternatives]]`; the engine's
finishing EOS/stop token is counted in usage and listed in logprobs, but never shown as text.
"""

from __future__ import annotations

from typing import Any

import orjson

from services.gateway.frontend import ChoiceUpdate, Generation
from services.gateway.token_text import TokenTexts

SYSTEM_FINGERPRINT = "pagedserve-0.1"


def sse(data: Any) -> bytes:
    payload = data.encode() if isinstance(data, str) else orjson.dumps(data)
    return b"data: " + payload + b"\n\n"


def chat_logprobs(texts: TokenTexts, update: ChoiceUpdate) -> dict[str, Any] | None:
    if update.logprobs is None:
        return None
    content = []
    for token_id, (logprob, top) in zip(update.token_ids, update.logprobs):
        text, raw = texts.get(token_id)
        alternatives = []
        for alt_id, alt_logprob in top:
            alt_text, alt_raw = texts.get(alt_id)
            alternatives.append({"token": alt_text, "logprob": alt_logprob, "bytes": alt_raw})
        content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenTexts, update: ChoiceUpdate, text_offset: int) -> dict[str, Any] | None:
    if update.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, (logprob, top) in zip(update.token_ids, update.logprobs):
        text = texts.text(token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append({texts.text(alt_id): alt_logprob for alt_id, alt_logprob in top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def merge_logprobs(total: dict[str, Any] | None, part: dict[str, Any] | None) -> dict[str, Any] | None:
    if part is None:
        return total
    if total is None:
        return {k: list(v) if isinstance(v, list) else v for k, v in part.items()}
    for key, values in part.items():
        if isinstance(values, list):
            total[key].extend(values)
    return total


def envelope(gen: Generation, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": gen.request_id, "object": obj, "created": gen.created, "model": gen.model,
        "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
    }


def chat_chunk(gen: Generation, update: ChoiceUpdate, is_first: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": update.text} if is_first else {"content": update.text}
    choice = {
        "index": update.index, "delta": delta, "logprobs": chat_logprobs(gen.token_texts, update),
        "finish_reason": update.finish_reason,
    }
    return envelope(gen, "chat.completion.chunk", [choice])


def completion_chunk(gen: Generation, update: ChoiceUpdate, text_offset: int) -> dict[str, Any]:
    choice = {
        "index": update.index, "text": update.text,
        "logprobs": completion_logprobs(gen.token_texts, update, text_offset), "finish_reason": update.finish_reason,
    }
    return envelope(gen, "text_completion", [choice])


def usage_chunk(gen: Generation, obj: str) -> dict[str, Any]:
    return {**envelope(gen, obj, []), "usage": gen.usage()}


def chat_response(gen: Generation, texts: list[str], logprobs: list[Any]) -> dict[str, Any]:
    choices = [
        {
            "index": i, "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs[i], "finish_reason": gen.finish_reasons.get(i),
        }
        for i, text in enumerate(texts)
    ]
    return {**envelope(gen, "chat.completion", choices), "usage": gen.usage()}


def completion_response(gen: Generation, texts: list[str], logprobs: list[Any]) -> dict[str, Any]:
    choices = [
        {"index": i, "text": text, "logprobs": logprobs[i], "finish_reason": gen.finish_reasons.get(i)}
        for i, text in enumerate(texts)
    ]
    return {**envelope(gen, "text_completion", choices), "usage": gen.usage()}
