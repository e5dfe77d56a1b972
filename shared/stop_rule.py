"""When a sequence stops: one rule, applied to token ids by the engine and to text by the gateway.

    stop    an EOS id of the model or one of the request's stop_token_ids, once min_tokens output tokens
            exist (the finishing token counts as output; the gateway never shows it) -- engine;
            or the first of the request's stop strings in the detokenized text, cut where it begins
            (vLLM's stop_reason is that string) -- gateway
    length  max_tokens output tokens, or the context (max_model_len) is full -- engine

A stop token wins over a length limit reached by the same token. While a stream is open the gateway
holds back the last (longest stop string - 1) characters, so a stop string split across tokens is
never half sent.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence


def is_stop_token(
    token_id: int, num_output: int, min_tokens: int, eos_token_ids: Collection[int], stop_token_ids: Collection[int]
) -> bool:
    """Whether `token_id`, the `num_output`-th output token, ends the sequence with "stop"."""
    return num_output >= min_tokens and (token_id in eos_token_ids or token_id in stop_token_ids)


def is_length_reached(num_output: int, max_tokens: int, num_tokens: int, max_model_len: int) -> bool:
    return num_output >= max_tokens or num_tokens >= max_model_len


def stop_reason(
    token_id: int,
    num_output: int,
    num_tokens: int,
    *,
    min_tokens: int,
    max_tokens: int,
    max_model_len: int,
    eos_token_ids: Collection[int],
    stop_token_ids: Collection[int],
) -> str | None:
    """Why a sequence of `num_tokens` (prompt + `num_output`) ends now that `token_id` was appended, or None."""
    if is_stop_token(token_id, num_output, min_tokens, eos_token_ids, stop_token_ids):
        return "stop"
    if is_length_reached(num_output, max_tokens, num_tokens, max_model_len):
        return "length"
    return None


def find_stop_string(text: str, stop_strings: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """(where the earliest stop string begins in `text[start:]`'s search, which one), or None."""
    hits = [(i, s) for s in stop_strings if (i := text.find(s, start)) >= 0]
    return min(hits, key=lambda hit: hit[0]) if hits else None


def held_back(stop_strings: Sequence[str]) -> int:
    """Characters a stream holds back so a stop string split across tokens is never half sent."""
    return max((len(s) for s in stop_strings), default=1) - 1
