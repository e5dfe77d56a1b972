"""A response's output items as they grow, and the stream events that say so, in OpenAI's order.

    reasoning      output_item.added, content_part.added (reasoning_text), reasoning_text.delta...,
                   reasoning_text.done, content_part.done, output_item.done
    message        output_item.added, content_part.added (output_text), output_text.delta...,
                   output_text.done, content_part.done, output_item.done
    function_call  output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                   output_item.done

One item is open at a time: text of another kind closes it and opens the next (reasoning, then the answer,
then its tool calls). Tool calls come in chat's delta shape (tool_calls.py): a delta with an `id` starts a
call, later ones add to its arguments. A non-streamed response is built the same way, its events unsent.
"""

from __future__ import annotations

import uuid
from typing import Any

Event = tuple[str, dict[str, Any]]  # (type, fields)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # closed items, in order
        self._open: dict[str, Any] | None = None
        self._text = ""  # the open item's text or arguments so far

    @property
    def output_text(self) -> str:
        return "".join(p["text"] for i in self.items if i["type"] == "message" for p in i["content"])

    def reasoning(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = self._open_item("reasoning") if not self._is_open("reasoning") else []
        self._text += delta
        return [*events, ("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": delta})]

    def text(self, delta: str) -> list[Event]:
        if not delta:
            return []
        events = self._open_item("message") if not self._is_open("message") else []
        self._text += delta
        fields = {**self._where(), "content_index": 0, "delta": delta, "logprobs": []}
        return [*events, ("response.output_text.delta", fields)]

    def tool_call(self, delta: dict[str, Any]) -> list[Event]:
        function = delta.get("function") or {}
        events: list[Event] = []
        if delta.get("id"):
            events = self._open_item("function_call", call_id=delta["id"], name=function.get("name") or "")
        arguments = function.get("arguments") or ""
        if arguments and self._is_open("function_call"):
            self._text += arguments
            events.append(("response.function_call_arguments.delta", {**self._where(), "delta": arguments}))
        return events

    def close(self, status: str = "completed") -> list[Event]:
        """Close the open item (`status`: completed, or incomplete when the output was cut)."""
        item, text = self._open, self._text
        if item is None:
            return []
        self._open, self._text = None, ""
        where = {"item_id": item["id"], "output_index": len(self.items)}
        item["status"] = status
        events: list[Event] = []
        if item["type"] == "function_call":
            item["arguments"] = text
            done = {**where, "name": item["name"], "arguments": text}
            events.append(("response.function_call_arguments.done", done))
        else:
            is_reasoning = item["type"] == "reasoning"
            part = _part("reasoning_text" if is_reasoning else "output_text", text)
            item["content"] = [part]
            kind = "response.reasoning_text.done" if is_reasoning else "response.output_text.done"
            done = {**where, "content_index": 0, "text": text, **({} if is_reasoning else {"logprobs": []})}
            events += [(kind, done), ("response.content_part.done", {**where, "content_index": 0, "part": part})]
        events.append(("response.output_item.done", {"output_index": len(self.items), "item": item}))
        self.items.append(item)
        return events

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items)}

    def _open_item(self, kind: str, **fields: Any) -> list[Event]:
        events = self.close()
        if kind == "function_call":
            item = {"type": kind, "id": _new_id("fc"), **fields, "arguments": "", "status": "in_progress"}
        elif kind == "reasoning":
            item = {"type": kind, "id": _new_id("rs"), "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"type": kind, "id": _new_id("msg"), "status": "in_progress", "role": "assistant", "content": []}
        self._open = item
        events.append(("response.output_item.added", {"output_index": len(self.items), "item": dict(item)}))
        if kind != "function_call":
            part = _part("reasoning_text" if kind == "reasoning" else "output_text", "")
            events.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": part}))
        return events


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning_text":
        return {"type": kind, "text": text}
    return {"type": kind, "text": text, "annotations": [], "logprobs": []}
