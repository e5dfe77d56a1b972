"""gpt-oss's harmony format (`openai`): the answer is a run of messages, each a header and a body.

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

A body addressed `to=functions.NAME` is a call with JSON arguments; the `final` channel (and `commentary`
with no recipient, a preamble) is content; `analysis` is reasoning, never content. `<|call|>` and `<|return|>`
are stop tokens, so the text usually ends without them: the output's end closes the last message.
The markup is parsed here as text (the openai-harmony package wants token ids and its own encoding files).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pagedserve.services.gateway.tool_parsers.arguments import RawArguments
from pagedserve.services.gateway.tool_parsers.calls import CallSink
from pagedserve.services.gateway.tool_parsers.markers import MarkerSplitter

HEADER_MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>")
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (*HEADER_MARKERS, "<|message|>", *BODY_ENDS)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


@dataclass(slots=True)
class HarmonyParser:
    properties: dict[str, dict[str, Any]] = field(default_factory=dict)  # (unused: arguments are JSON already)
    sink: CallSink = field(default_factory=CallSink)
    content: str = ""
    _kind: str = "content"  # the body being read: content | call | hidden; "header" while reading one
    _header: str = ""
    _arguments: RawArguments | None = None
    _out: list[str] = field(default_factory=list)
    _is_finished: bool = False
    _splitter: MarkerSplitter = field(default_factory=lambda: MarkerSplitter(lambda: MARKERS))

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        for kind, piece in self._splitter.feed(text):
            self._on(kind, piece)
        return self._take()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if not self._is_finished:
            self._is_finished = True
            for kind, piece in self._splitter.feed("", is_last=True):
                self._on(kind, piece)
            self._end_body(closed=True)  # <|call|> is a stop token: the call ended with the output
        return self._take()

    def _take(self) -> tuple[str, list[dict[str, Any]]]:
        content, self._out = "".join(self._out), []
        self.content += content
        return content, self.sink.take()

    def _on(self, kind: str, piece: str) -> None:
        if kind == "text":
            if self._kind == "header":
                self._header += piece
            elif self._kind == "content":
                self._out.append(piece)
            elif self._kind == "call" and self._arguments is not None:
                self.sink.arguments(self._arguments.feed(piece))
        elif piece in HEADER_MARKERS:
            if self._kind != "header":
                self._end_body(closed=piece == "<|start|>")
                self._kind, self._header = "header", ""
            self._header += piece
        elif piece == "<|message|>" and self._kind == "header":
            self._start_body()
        elif piece in BODY_ENDS:
            self._end_body(closed=piece == "<|call|>" or self._kind != "call")
            self._kind = "hidden"  # until the next header: nothing between messages is content

    def _start_body(self) -> None:
        recipient = _RECIPIENT.search(self._header)
        channel = _CHANNEL.search(self._header)
        if recipient is not None:
            self._kind = "call"
            self.sink.open(recipient.group(1))
            self._arguments = RawArguments()
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "hidden"
        else:
            self._kind = "content"

    def _end_body(self, closed: bool) -> None:
        if self._kind == "call" and self._arguments is not None:
            self.sink.arguments(self._arguments.close())
            if closed:
                self.sink.close()
            self._arguments = None
        self._kind = "hidden"
