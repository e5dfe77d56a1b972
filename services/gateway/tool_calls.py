"""Tool calls out of generated text, in OpenAI's shape, for each way a request can call tools.

    named     tool_choice names a function: the whole output is its arguments (grammar-enforced)
    required  the output is a JSON array [{"name", "arguments"}, ...] (grammar-enforced)
    hermes    auto, Hermes format: content, then <tool_call>{"name", "arguments"}</tool_call> ...
    llama3    auto, Llama-3 JSON: an output that starts with "{" is {"name", "parameters"} (";"-separated)

`ChoiceToolCalls.feed` turns each text delta into (content delta, tool-call deltas) for a stream;
`finish` settles the end; `message` gives the non-streaming message. Auto-mode output whose calls
are not valid JSON is returned as plain content (never a half-parsed call) when not streaming.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.services.gateway.tool_scanner import ToolCallScanner

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_PREFIX = "<|python_tag|>"
PARSERS = ("hermes", "llama3")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ChoiceToolCalls:
    mode: str  # named | required | hermes | llama3
    function_name: str | None = None  # named mode
    scanner: ToolCallScanner = field(default_factory=ToolCallScanner)
    text: str = ""  # everything generated so far
    content: str = ""  # what went out as content
    _pending: str = ""  # held back: may be the start of a tag (hermes) or undecided (llama3)
    _inside: bool = False  # hermes: within <tool_call> ... </tool_call>
    _decided: bool | None = None  # llama3: None until the first visible character; True = calls
    _ids: list[str] = field(default_factory=list)
    _named_started: bool = False
    _had_tag: bool = False
    _early_arguments: dict[int, str] = field(default_factory=dict)

    # ── streaming ──────────────────────────────────────────────────────────────────────────
    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        if self.mode == "named":
            return "", self._named_deltas(delta)
        if self.mode == "required":
            return "", self._call_deltas(delta)
        if self.mode == "llama3":
            return self._feed_llama3(delta)
        return self._feed_hermes(delta)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: held-back text that turned out to be content."""
        tail, self._pending = self._pending, ""
        if self.mode == "hermes" and self._inside:
            return "", []
        if self.mode == "llama3" and self._decided:
            return "", []
        self.content += tail
        return tail, []

    @property
    def has_calls(self) -> bool:
        return bool(self._ids)

    def _named_deltas(self, delta: str) -> list[dict[str, Any]]:
        deltas = []
        if not self._named_started:
            self._named_started = True
            self._ids.append(new_call_id())
            deltas.append(_header(0, self._ids[0], self.function_name or ""))
        if delta:
            deltas.append({"index": 0, "function": {"arguments": delta}})
        return deltas

    def _call_deltas(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        for event in self.scanner.feed(text):
            if event.name is not None:
                self._ids.append(new_call_id())
                deltas.append(_header(event.index, self._ids[event.index], event.name))
                early = self._early_arguments.pop(event.index, "")  # arguments written before the name
                if early:
                    deltas.append({"index": event.index, "function": {"arguments": early}})
            elif event.index < len(self._ids):
                deltas.append({"index": event.index, "function": {"arguments": event.arguments}})
            else:
                self._early_arguments[event.index] = self._early_arguments.get(event.index, "") + event.arguments
        return deltas

    def _feed_hermes(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        buffer, self._pending = self._pending + delta, ""
        content, deltas = "", []
        while buffer:
            tag = HERMES_CLOSE if self._inside else HERMES_OPEN
            at = buffer.find(tag)
            if at < 0:
                keep = _partial_suffix(buffer, tag)
                head, self._pending = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
                if self._inside:
                    deltas += self._call_deltas(head)
                else:
                    content += self._outside_text(head)
                break
            if self._inside:
                deltas += self._call_deltas(buffer[:at])
            else:
                content += self._outside_text(buffer[:at])
            self._inside = not self._inside
            self._had_tag = True
            buffer = buffer[at + len(tag) :]
        self.content += content
        return content, deltas

    def _outside_text(self, text: str) -> str:
        return "" if self._had_tag and not text.strip() else text  # whitespace between or after calls

    def _feed_llama3(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        if self._decided is None:
            buffer = (self._pending + delta).lstrip()
            if buffer.startswith(LLAMA3_PREFIX):
                buffer = buffer[len(LLAMA3_PREFIX) :].lstrip()
            if not buffer or LLAMA3_PREFIX.startswith(buffer):
                self._pending = buffer
                return "", []
            self._pending = ""
            self._decided = buffer.startswith("{")
            delta = buffer
        if self._decided:
            return "", self._call_deltas(delta)
        self.content += delta
        return delta, []

    # ── whole answers ──────────────────────────────────────────────────────────────────────
    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) for a non-streaming answer, from all the text fed so far."""
        if self.mode == "named":
            return None, [_call(new_call_id(), self.function_name or "", self.text)]
        self.finish()
        calls = [c for c in self.scanner.calls if c.name is not None]
        if self.mode != "required" and (not calls or not all(_is_json(c.arguments) for c in calls)):
            return self.text, []  # auto: no (valid) call, so it was an ordinary answer
        tool_calls = [_call(new_call_id(), c.name or "", c.arguments or "{}") for c in calls]
        return (self.content.strip() or None), tool_calls


def _header(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def tool_call_states(
    mode: str,
    function_name: str | None,
    parser: str,
    num_choices: int,
) -> list[ChoiceToolCalls] | None:
    """One parser per choice for a request's tool_choice mode (none/auto/required/named), or None."""
    if mode == "none":
        return None
    kind = parser if mode == "auto" else mode
    return [ChoiceToolCalls(kind, function_name) for _ in range(num_choices)]


def finish_reason(state: ChoiceToolCalls, reason: str | None) -> str | None:
    """A choice that called tools and ended normally finishes with "tool_calls"."""
    return "tool_calls" if reason == "stop" and state.has_calls else reason
