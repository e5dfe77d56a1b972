"""OpenAI response bodies and stream chunks for chat and text completions."""

from __future__ import annotations

import json
from typing import Any

from services.gateway.frontend import ChoiceUpdate, Generation

SYSTEM_FINGERPRINT = "pagedserve-0.1"


def sse(data: Any) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def _token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def chat_logprobs(tokenizer: Any, update: ChoiceUpdate) -> dict[str, Any] | None:
    if update.logprobs is None:
        return None
    content = []
    for token_id, (logprob, top) in zip(update.token_ids, update.logprobs):
        text = _token_text(tokenizer, token_id)
        content.append({
            "token": text, "logprob": logprob, "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (t := _token_text(tokenizer, tid)), "logprob": lp, "bytes": list(t.encode())}
                for tid, lp in top
            ],
        })
    return {"content": content}


def completion_logprobs(tokenizer: Any, update: ChoiceUpdate, text_offset: int) -> dict[str, Any] | None:
    if update.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, (logprob, top) in zip(update.token_ids, update.logprobs):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append({_token_text(tokenizer, tid): lp for tid, lp in top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def merge_logprobs(total: dict[str, Any] | None, part: dict[str, Any] | None) -> dict[str, Any] | None:
    if part is None:
        return total
    if total is None:
        return {k: list(v) for k, v in part.items()}
    for key, values in part.items():
        total[key].extend(values)
    return total


def _envelope(gen: Generation, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": gen.request_id, "object": obj, "created": gen.created, "model": gen.model,
        "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
    }


def chat_chunk(gen: Generation, update: ChoiceUpdate, is_first: bool, tokenizer: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": update.text} if is_first else {"content": update.text}
    choice = {
        "index": update.index, "delta": delta, "logprobs": chat_logprobs(tokenizer, update),
        "finish_reason": update.finish_reason,
    }
    return _envelope(gen, "chat.completion.chunk", [choice])


def completion_chunk(gen: Generation, update: ChoiceUpdate, text_offset: int, tokenizer: Any) -> dict[str, Any]:
    choice = {
        "index": update.index, "text": update.text,
        "logprobs": completion_logprobs(tokenizer, update, text_offset), "finish_reason": update.finish_reason,
    }
    return _envelope(gen, "text_completion", [choice])


def usage_chunk(gen: Generation, obj: str) -> dict[str, Any]:
    return {**_envelope(gen, obj, []), "usage": gen.usage()}


def chat_response(gen: Generation, texts: list[str], logprobs: list[Any]) -> dict[str, Any]:
    choices = [
        {
            "index": i, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs[i], "finish_reason": gen.finish_reasons.get(i),
        }
        for i, text in enumerate(texts)
    ]
    return {**_envelope(gen, "chat.completion", choices), "usage": gen.usage()}


def completion_response(gen: Generation, texts: list[str], logprobs: list[Any]) -> dict[str, Any]:
    choices = [
        {"index": i, "text": text, "logprobs": logprobs[i], "finish_reason": gen.finish_reasons.get(i)}
        for i, text in enumerate(texts)
    ]
    return {**_envelope(gen, "text_completion", choices), "usage": gen.usage()}
