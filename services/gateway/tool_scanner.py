"""An incremental scanner for tool calls written as JSON objects: `{"name": ..., "arguments": {...}}`.

Text arrives in pieces (stream deltas); the scanner reports, per call, its name once the name
string is complete and the raw text of its arguments as it grows, so the arguments can stream as
OpenAI's `function.arguments` fragments. Anything outside an object (`[`, `,`, `;`, whitespace,
tags) is ignored, so one scanner serves a JSON array of calls, Llama-3's `{...}; {...}` and the
inside of Hermes `<tool_call>` tags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(slots=True)
class ScannedCall:
    name: str | None = None
    arguments: str = ""  # raw JSON text so far
    is_complete: bool = False


@dataclass(slots=True)
class CallEvent:
    index: int
    name: str | None  # set once, when the name completes
    arguments: str  # a new fragment of the arguments ("" when none)
    ends: bool = False  # the call's object closed here


@dataclass(slots=True)
class ToolCallScanner:
    argument_keys: tuple[str, ...] = ("arguments", "parameters")
    calls: list[ScannedCall] = field(default_factory=list)
    _depth: int = 0  # 0: between calls; 1: inside a call object
    _in_string: bool = False
    _escape: bool = False
    _string: list[str] = field(default_factory=list)
    _key: str | None = None
    _expect_value: bool = False
    _args_depth: int | None = None  # capturing arguments: nesting inside them (0 = a scalar value)
    _args_started: bool = False

    def feed(self, text: str) -> list[CallEvent]:
        events: list[CallEvent] = []
        for char in text:
            self._char(char, events)
        return _merge(events)

    def _char(self, c: str, events: list[CallEvent]) -> None:
        if self._args_depth is not None and self._capture(c, events):
            return
        if self._depth == 0:
            if c == "{":
                self._depth, self._key, self._expect_value = 1, None, False
                self.calls.append(ScannedCall())
            return
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                self._end_string(events)
                return
            self._string.append(c)
        elif c == '"':
            self._in_string, self._string = True, []
        elif c == ":":
            self._expect_value = True
        elif c == ",":
            self._expect_value = False
        elif c == "}":
            self._depth = 0
            self.calls[-1].is_complete = True
            events.append(CallEvent(len(self.calls) - 1, None, "", ends=True))
        elif self._expect_value and not c.isspace() and self._key in self.argument_keys:
            self._args_depth, self._args_started = 0, False
            self._capture(c, events)

    def _end_string(self, events: list[CallEvent]) -> None:
        text = "".join(self._string)
        if not self._expect_value:
            self._key = text
            return
        if self._key == "name" and self.calls[-1].name is None:
            try:
                self.calls[-1].name = json.loads(f'"{text}"')
            except ValueError:
                self.calls[-1].name = text
            events.append(CallEvent(len(self.calls) - 1, self.calls[-1].name, ""))
        self._expect_value = False

    def _capture(self, c: str, events: list[CallEvent]) -> bool:
        """Take `c` into the arguments; False when it ends a scalar value (the caller handles it)."""
        assert self._args_depth is not None
        if not self._args_started:
            self._args_started = True
            self._in_string, self._escape = c == '"', False
            self._args_depth = 1 if c in "{[" else 0
            self._emit(c, events)
            return True
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._args_depth += 1
        elif c in "}]" or (c == "," and self._args_depth == 0):
            if self._args_depth == 0:  # the end of a scalar value: the object's own ',' or '}'
                self._stop_capture()
                return False
            self._args_depth -= 1
            if self._args_depth == 0:
                self._emit(c, events)
                self._stop_capture()
                return True
        self._emit(c, events)
        return True

    def _stop_capture(self) -> None:
        self._args_depth, self._expect_value, self._in_string = None, False, False

    def _emit(self, c: str, events: list[CallEvent]) -> None:
        self.calls[-1].arguments += c
        events.append(CallEvent(len(self.calls) - 1, None, c))


def _merge(events: list[CallEvent]) -> list[CallEvent]:
    """Join consecutive argument characters of one call into one fragment."""
    merged: list[CallEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.index == event.index
            and event.name is None
            and last.name is None
            and not (event.ends or last.ends)
        ):
            last.arguments += event.arguments
        else:
            merged.append(CallEvent(event.index, event.name, event.arguments, event.ends))
    return merged
