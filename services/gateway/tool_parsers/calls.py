"""Tool calls as they stream out, in OpenAI's delta shape, and as the whole message's `tool_calls`.

    {"index": i, "id": ..., "type": "function", "function": {"name": ..., "arguments": ""}}   once per call
    {"index": i, "function": {"arguments": fragment}}                                           then, any number

A parser reports `open(name)`, `arguments(fragment)` and `close()` for each call in order; the sink numbers the
calls, gives them ids, drops calls past `max_calls` (parallel_tool_calls false) and keeps what was sent, so the
non-streaming message is built from the very same events.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    is_closed: bool = False  # its end was seen (or the format lets the output's end close it)

    def as_message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    @property
    def is_valid(self) -> bool:
        """A name and, once closed, arguments that are one JSON object."""
        if not self.name or not self.is_closed:
            return False
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False


@dataclass(slots=True)
class CallSink:
    max_calls: int | None = None  # parallel_tool_calls false: 1
    calls: list[ParsedCall] = field(default_factory=list)
    deltas: list[dict[str, Any]] = field(default_factory=list)  # not yet sent
    num_opened: int = 0  # calls the model began, kept or not
    is_broken: bool = False  # markup that could not be read as a call (the answer is then plain text)
    _open: ParsedCall | None = None

    def open(self, name: str, call_id: str | None = None) -> None:
        """A new call; the one before it stays unclosed unless its parser said `close` (cut-off markup)."""
        self._open = None
        self.num_opened += 1
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return
        call = ParsedCall(call_id or new_call_id(), name)
        self.calls.append(call)
        self._open = call
        header = {"name": name, "arguments": ""}
        self.deltas.append({"index": len(self.calls) - 1, "id": call.id, "type": "function", "function": header})

    def arguments(self, fragment: str) -> None:
        if self._open is None or not fragment:
            return
        self._open.arguments += fragment
        index = len(self.calls) - 1
        last = self.deltas[-1] if self.deltas else None
        if last is not None and last["index"] == index and "id" not in last:  # one fragment per feed
            last["function"]["arguments"] += fragment
        else:
            self.deltas.append({"index": index, "function": {"arguments": fragment}})

    def close(self) -> None:
        """The open call's markup ended properly; one written without arguments has `{}`."""
        if self._open is not None:
            if not self._open.arguments:
                self.arguments("{}")
            self._open.is_closed = True
            self._open = None

    def take(self) -> list[dict[str, Any]]:
        deltas, self.deltas = self.deltas, []
        return deltas
