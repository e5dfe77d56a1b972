"""What lies between a call's markers, for each way families write it. Each body reports to a CallSink.

JsonCalls   {"name": ..., "arguments"|"parameters": {...}} objects, one or several (an array, ';'-separated)
NamedCall   NAME <separator> ARGUMENTS: the name up to a family's pattern, then JSON or XML arguments
FirstChar   Mistral: JSON objects when the call starts with '[' or '{', a named call otherwise
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.services.gateway.tool_parsers.arguments import Arguments
from pagedserve.services.gateway.tool_parsers.calls import CallSink
from pagedserve.services.gateway.tool_scanner import ToolCallScanner


class Body(Protocol):
    def feed(self, text: str) -> str | None: ...  # None, or the text after a body that ended by itself

    def end(self, closed: bool) -> None: ...  # its markup ended; `closed`: properly (not cut off)


@dataclass(slots=True)
class JsonCalls:
    sink: CallSink
    scanner: ToolCallScanner = field(default_factory=ToolCallScanner)
    _sink_index: int | None = None  # the scanner's call that is the sink's open call
    _early: dict[int, str] = field(default_factory=dict)  # arguments written before their call's name

    def feed(self, text: str) -> None:
        for event in self.scanner.feed(text):
            if event.name is not None:
                self.sink.open(event.name)
                self._sink_index = event.index
                self.sink.arguments(self._early.pop(event.index, ""))
            elif event.ends:
                if event.index == self._sink_index:
                    self.sink.close()
                    self._sink_index = None
            elif event.index == self._sink_index:
                self.sink.arguments(event.arguments)
            else:
                self._early[event.index] = self._early.get(event.index, "") + event.arguments
        return None

    def end(self, closed: bool) -> None:
        pass  # an object is complete when its braces close, whatever markup follows


@dataclass(slots=True)
class NamedCall:
    sink: CallSink
    name_pattern: re.Pattern[str]  # from the call's start; group "name"; the arguments follow the match
    new_arguments: Callable[[str], Arguments]  # for the tool of that name
    name_of: Callable[[str], str] = str.strip
    id_of: Callable[[str], str | None] = lambda raw: None
    _head: str = ""
    _arguments: Arguments | None = None

    def feed(self, text: str) -> None:
        if self._arguments is None:
            self._head += text
            match = self.name_pattern.match(self._head)
            if match is None:
                return None
            self._start(match.group("name"))
            text = self._head[match.end() :]
        assert self._arguments is not None
        self.sink.arguments(self._arguments.feed(text))
        return None

    def _start(self, raw: str) -> None:
        name = self.name_of(raw)
        self.sink.open(name, self.id_of(raw))
        self._arguments = self.new_arguments(name)

    def end(self, closed: bool) -> None:
        if self._arguments is None:
            if not self._head.strip():
                return
            self._start(self._head)  # a call with a name and no arguments
        assert self._arguments is not None
        self.sink.arguments(self._arguments.close())
        if closed:
            self.sink.close()


@dataclass(slots=True)
class FirstChar:
    """Chooses a body by the call's first visible character."""

    choose: Callable[[str], Body]
    _body: Body | None = None

    def feed(self, text: str) -> str | None:
        if self._body is None:
            if not text.strip():
                return None
            self._body = self.choose(text.lstrip()[0])
        return self._body.feed(text)

    def end(self, closed: bool) -> None:
        if self._body is not None:
            self._body.end(closed)
