"""Prompt token ids from a chat or a text prompt, and vocabulary checks: the one place both the tokenizer
service and the gateway's `/tokenize` / `/detokenize` render chat templates and check token ids, so the two
can never disagree (shared/, because services never import each other).

Chat templates run in transformers' sandboxed Jinja environment. User-supplied
`chat_template_kwargs` become template variables only: keys that would change how
`apply_chat_template` itself behaves (a different template, tools, truncation, ...) are refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

# apply_chat_template's own parameters (and this module's), never taken from a request.
_FIXED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


def check_template_kwargs(template_kwargs: dict[str, Any], tokenizer: Any = None) -> None:
    """Raise ValueError naming a reserved key (with a tokenizer: this transformers version's parameters too)."""
    reserved_keys = set(_FIXED_KWARGS)
    if tokenizer is not None:
        params = inspect.signature(tokenizer.apply_chat_template).parameters
        reserved_keys.update(name for name, p in params.items() if p.kind is not p.VAR_KEYWORD)
    reserved = sorted(set(template_kwargs) & reserved_keys)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render the chat template and tokenize it (the template adds its own special tokens)."""
    kwargs = dict(template_kwargs or {})
    check_template_kwargs(kwargs, tokenizer)
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs,
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding anyway
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def text_prompt_ids(tokenizer: Any, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    """A completion prompt: text is tokenized, token ids pass through unchanged."""
    if isinstance(prompt, str):
        return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
    return list(prompt)


def first_out_of_vocab(token_ids: Iterable[object], vocab_size: int) -> object | None:
    """The first id that is not an int in [0, vocab_size), or None when all are."""
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            return t
    return None
