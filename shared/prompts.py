"""Prompt token ids from a chat or a text prompt, and vocabulary checks: the one place both the tokenizer
service and the gateway's `/tokenize` / `/detokenize` render chat templates and check token ids, so the two
can never disagree (shared/, because services never import each other).

Chat templates run in transformers' sandboxed Jinja environment. User-supplied
`chat_template_kwargs` become template variables only: keys that would change how
`apply_chat_template` itself behaves (a different template, tools, truncation, ...) are refused.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from typing import Any, cast

# apply_chat_template's own parameters (and this module's), never taken from a request.
_FIXED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


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
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    documents: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Render the chat template and tokenize it (the template adds its own special tokens).
    `tools` reach the template as HF's `apply_chat_template(tools=...)` passes them; a template
    that ignores tools gets them (and the history's calls) in the Hermes format instead."""
    kwargs = dict(template_kwargs or {})
    check_template_kwargs(kwargs, tokenizer)
    if tools and not template_handles_tools(tokenizer):
        messages, tools = hermes_messages(messages, tools), None
    ids = tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        tools=tools,
        continue_final_message=continue_final_message,
        documents=documents,
        **kwargs,
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
    if isinstance(token_ids, list) and token_ids and set(map(type, token_ids)) == {int}:
        ints = cast(list[int], token_ids)
        if min(ints) >= 0 and max(ints) < vocab_size:
            return None  # a prompt's ids checked in C, not a Python loop
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            return t
    return None


def template_handles_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return "tools" in template


HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
    "about what values to plug into functions. Here are the available tools: <tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call>"
    '</tool_call> XML tags as follows:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-dict>}}\n</tool_call>"
)


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools in a system message and calls as <tool_call> text: for templates that know no tools."""
    described = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    system = HERMES_SYSTEM.format(tools=described)
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            text = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False
                )
                + "\n</tool_call>"
                for c in calls
            )
            message["content"] = ((message.get("content") or "") + "\n" + text).strip()
        out.append(message)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out
