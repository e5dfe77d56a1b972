"""OpenAI response bodies and stream chunks for chat and text completions.

Logprobs arrive per token as `[logprob, [[token_id, logprob], ...top alternatives]]`; the engine's
finishing EOS/stop token is counted in usage and listed in logprobs, but never shown as text.
"""

from __future__ import annotations

from typing import Any

import orjson

from pagedserve.services.gateway.batch import GenerationView
from pagedserve.services.gateway.frontend import ChoiceUpdate, Generation
from pagedserve.services.gateway.token_text import TokenTexts

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
        # The sampled token is always listed (OpenAI's rule: logprobs=0 gives one entry, 5 gives 5 or 6).
        top_logprobs.append({text: logprob, **{texts.text(alt_id): alt_logprob for alt_id, alt_logprob in top}})
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


def envelope(gen: GenerationView, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": gen.response_id or gen.request_id,
        "object": obj,
        "created": gen.created,
        "model": gen.served_model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": choices,
    }


def stop_reason(gen: GenerationView, index: int) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or the request's stop token id that ended the choice; None for
    EOS or length."""
    if index >= len(gen.choices):
        return None
    choice = gen.choices[index]
    return choice.stop_string if choice.stop_string is not None else choice.stop_token_id


def chat_chunk(gen: Generation, update: ChoiceUpdate, is_first: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": update.text} if is_first else {"content": update.text}
    choice = {
        "index": update.index,
        "delta": delta,
        "logprobs": chat_logprobs(gen.token_texts, update),
        "finish_reason": update.finish_reason,
        "stop_reason": stop_reason(gen, update.index) if update.finish_reason else None,
    }
    return envelope(gen, "chat.completion.chunk", [choice])


def completion_chunk(gen: GenerationView, update: ChoiceUpdate, text_offset: int) -> dict[str, Any]:
    choice = {
        "index": update.index,
        "text": update.text,
        "logprobs": completion_logprobs(gen.token_texts, update, text_offset),
        "finish_reason": update.finish_reason,
        "stop_reason": stop_reason(gen, update.index) if update.finish_reason else None,
    }
    return envelope(gen, "text_completion", [choice])


def usage_chunk(gen: GenerationView, obj: str) -> dict[str, Any]:
    return {**envelope(gen, obj, []), "usage": gen.usage()}


def chat_response(gen: GenerationView, texts: list[str], logprobs: list[Any]) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs[i],
            "finish_reason": gen.finish_reasons.get(i),
            "stop_reason": stop_reason(gen, i),
        }
        for i, text in enumerate(texts)
    ]
    # vLLM sends prompt_logprobs: null when not asked for; clients read the key.
    return {**envelope(gen, "chat.completion", choices), "usage": gen.usage(), "prompt_logprobs": None}


def completion_response(gen: GenerationView, texts: list[str], logprobs: list[Any]) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": text,
            "logprobs": logprobs[i],
            "finish_reason": gen.finish_reasons.get(i),
            "stop_reason": stop_reason(gen, i),
            "prompt_logprobs": None,
        }
        for i, text in enumerate(texts)
    ]
    return {**envelope(gen, "text_completion", choices), "usage": gen.usage()}


def echo_logprobs(texts: TokenTexts, gen: Generation, k: int) -> dict[str, Any]:
    """Completion logprobs of the prompt tokens (echo + logprobs): the first one has none (null)."""
    entries = gen.prompt_logprobs or []
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for position, token_id in enumerate(gen.accepted.prompt_token_ids):
        text = texts.text(token_id)
        entry = entries[position] if position < len(entries) else None
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        token_logprobs.append(None if entry is None else entry[0])
        top_logprobs.append(None if entry is None else {texts.text(t): lp for t, lp in entry[1][:k]})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def vllm_prompt_logprobs(texts: TokenTexts, gen: Generation, k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or the token itself and the top k,
    keyed by token id: {"123": {"logprob", "rank" (null if not in the top k), "decoded_token"}}."""
    result: list[dict[str, Any] | None] = []
    for token_id, entry in zip(gen.accepted.prompt_token_ids, gen.prompt_logprobs or []):
        if entry is None:
            result.append(None)
            continue
        top = entry[1][:k]
        ranks = {t: rank for rank, (t, _) in enumerate(top, start=1)}
        item = {
            str(token_id): {"logprob": entry[0], "rank": ranks.get(token_id), "decoded_token": texts.text(token_id)}
        }
        for rank, (t, lp) in enumerate(top, start=1):
            item.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": texts.text(t)})
        result.append(item)
    return result


def as_legacy_function_call(body: dict[str, Any]) -> None:
    """A chat answer in the shape of OpenAI's legacy function calling: the first tool call becomes
    `message.function_call` (one call per answer), `finish_reason` "function_call"."""
    for choice in body["choices"]:
        message = choice["message"]
        calls = message.pop("tool_calls", None)
        if calls:
            message["function_call"] = dict(calls[0]["function"])
            choice["finish_reason"] = "function_call"


def legacy_function_delta(calls: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Streamed tool-call deltas as the legacy `delta.function_call`: the first call only (one per answer)."""
    functions = [call.get("function") or {} for call in calls if call.get("index", 0) == 0]
    if not functions:
        return None
    delta = {"arguments": "".join(f.get("arguments") or "" for f in functions)}
    name = next((f["name"] for f in functions if f.get("name")), None)
    if name:
        delta["name"] = name
    return delta


def legacy_finish_reason(reason: str | None) -> str | None:
    return "function_call" if reason == "tool_calls" else reason
