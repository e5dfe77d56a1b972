"""/v1/responses items and tools, as the chat path takes them.

    message               {role, content: str | [input_text / output_text parts]}   -> that chat message
    function_call         {call_id, name, arguments}  -> an assistant message's tool_calls (consecutive ones: one)
    function_call_output  {call_id, output}           -> a tool message
    reasoning             {summary, content}          -> dropped: chat templates take no past reasoning
    tools [{type: function, name, parameters}]        -> chat's [{type: function, function: {...}}]
    tool_choice {type: function, name}                -> chat's {type: function, function: {name}}

Items arrive validated (the models below) from a request, or as the plain dicts a stored response keeps.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from pagedserve.services.gateway.messages import Strict


class TextPart(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(value: str | list[InputItem]) -> list[dict[str, Any]]:
    """A request's input as plain items, each with an id and a message's content as parts (what a stored
    response keeps, and GET .../input_items lists)."""
    if isinstance(value, str):
        value = [MessageItem(role="user", content=value)]
    items = []
    for given in value:
        item = given.model_dump(exclude_none=True) | {"type": _item_type(given)}
        item.setdefault("id", f"{_ID_PREFIXES[item['type']]}_{uuid.uuid4().hex}")
        if item["type"] == "message" and isinstance(item["content"], str):
            kind = "output_text" if item["role"] == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        items.append(item)
    return items


def item_page(items: list[dict[str, Any]], after: str | None, limit: int, order: str) -> dict[str, Any]:
    """OpenAI's list of items: `limit` of them in `order` (asc | desc), after the item with id `after`."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = ids.index(after) + 1 if after in ids else 0
    page = ordered[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(ordered),
    }


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type") or "message"
        if kind == "message":
            content = item["content"]
            text = content if isinstance(content, str) else "".join(part["text"] for part in content)
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": _function(item)}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # its text, or the calls before it
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _function(item: dict[str, Any]) -> dict[str, Any]:
    return {"name": item["name"], "arguments": item["arguments"]}


def chat_tools(tools: list[FunctionTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in tools]


def chat_tool_choice(choice: str | NamedFunction | None) -> Any:
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format: json_schema {name, schema, strict} or json_object."""
    fmt = dict((text or {}).get("format") or {})
    kind = fmt.pop("type", None)
    if kind in (None, "text"):
        return None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": fmt}
    return {"type": kind, **fmt}  # json_object; anything else is refused by chat's schema, naming the field
