"""The streaming core most families share: content, then calls marked by literal markers.

    content ─ open ─► call ─ close ─► content            (Hermes, GLM-4.5, Qwen3-Coder: one call per tag pair)
    content ─ block begin ─► between ─ open ─► call ─ close ─► between ─ block end ─► content   (DeepSeek, Kimi)
    content ─ open ─► call ─ open ─► call ... end of output                                    (Mistral, Granite)
    output starting with one of `at_start` ─► call ... end of output                           (Llama-3 JSON, pythonic)

A `ToolFormat` names the markers and how a call's inside is written (its `body`); `TaggedParser` runs them
over streamed text. Markup never reaches the content; whitespace between or after calls is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.services.gateway.tool_parsers.bodies import Body
from pagedserve.services.gateway.tool_parsers.calls import CallSink
from pagedserve.services.gateway.tool_parsers.markers import MarkerSplitter

BodyFactory = Callable[[CallSink, dict[str, dict[str, Any]]], Body]  # (sink, parameter schemas by tool name)
_CONTENT, _BETWEEN, _CALL = "content", "between", "call"


@dataclass(frozen=True, slots=True)
class ToolFormat:
    body: BodyFactory
    opens: tuple[str, ...] = ()  # markers that begin a call
    closes: tuple[str, ...] = ()  # markers that end one; none: the next call, the block's end or the output's end
    block: tuple[str, str] | None = None  # (begin, end) around all the calls: `opens` count only inside
    at_start: str = ""  # an output whose first visible character is one of these is calls (from that character)
    keeps_special_tokens: bool = True  # its markers are special tokens: the text must keep them


@dataclass(slots=True)
class TaggedParser:
    fmt: ToolFormat
    properties: dict[str, dict[str, Any]] = field(default_factory=dict)
    sink: CallSink = field(default_factory=CallSink)
    content: str = ""  # all the content sent
    _state: str = _CONTENT
    _body: Body | None = None
    _is_started: bool = False  # a visible character came
    _had_calls: bool = False  # markup was seen: whitespace after it is held back
    _held: str = ""  # such whitespace, sent only if text follows
    _unclaimed: str | None = None  # the markup so far, while it made no call (content again if none comes)
    _is_finished: bool = False
    _splitter: MarkerSplitter = field(init=False)
    _out: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._splitter = MarkerSplitter(self._markers)

    def _markers(self) -> tuple[str, ...]:
        fmt = self.fmt
        block_end = fmt.block[1:] if fmt.block else ()
        if self._state == _CONTENT:
            return fmt.block[:1] if fmt.block else fmt.opens
        if self._state == _BETWEEN:
            return fmt.opens + block_end
        return (fmt.closes or fmt.opens) + block_end

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        for kind, piece in self._splitter.feed(text):
            self._on(kind, piece)
        return self._take()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if not self._is_finished:
            self._is_finished = True
            for kind, piece in self._splitter.feed("", is_last=True):
                self._on(kind, piece)
            if self._body is not None:
                self._end_call(closed=not self.fmt.closes)  # the output's end closes a call only where no marker does
            if self._unclaimed is not None and not self.sink.num_opened:
                self._send(self._unclaimed)  # "[1, 2]" or '{"a": 1}': an answer that only looked like calls
        return self._take()

    def _take(self) -> tuple[str, list[dict[str, Any]]]:
        content, self._out = "".join(self._out), []
        self.content += content
        return content, self.sink.take()

    def _on(self, kind: str, piece: str) -> None:
        if self._unclaimed is not None and not self.sink.num_opened:
            self._unclaimed += piece
        if kind == "text":
            if self._state == _CONTENT:
                self._content(piece)
            elif self._state == _CALL:
                assert self._body is not None
                rest = self._body.feed(piece)
                if rest is not None:  # the body ended by itself (a pythonic list's "]")
                    self._end_call(closed=True)
                    if self.fmt.closes:  # what follows, up to the close marker, is still markup
                        self._body = _Rest()
                        return
                    self._state = _BETWEEN if self.fmt.block else _CONTENT
                    if self._unclaimed is not None and not self.sink.num_opened:  # "[1, 2]": text after all
                        self._send(self._unclaimed[: len(self._unclaimed) - len(rest)])
                        self._unclaimed = None
                    if rest and self._state == _CONTENT:
                        self._content(rest)
            return  # text between calls is not content
        if piece in self.fmt.closes and self._state == _CALL:
            self._end_call(closed=True)
            self._state = _BETWEEN if self.fmt.block else _CONTENT
        elif self.fmt.block and piece == self.fmt.block[1]:
            if self._body is not None:
                self._end_call(closed=not self.fmt.closes)
            self._state = _CONTENT
        elif self.fmt.block and piece == self.fmt.block[0] and self._state == _CONTENT:
            self._begin_markup(piece)
            self._state = _BETWEEN
        else:  # an open: in calls that end only where the next begins, it ends the one before
            if self._body is not None:
                self._end_call(closed=True)
            self._begin_markup(piece)
            self._start_call()

    def _content(self, text: str) -> None:
        if not self._is_started and self.fmt.at_start:
            text = text.lstrip()  # (Llama-3 JSON drops the whitespace a call would start after)
            if not text:
                return
            if text[0] in self.fmt.at_start:
                self._is_started = True
                self._begin_markup("")
                self._start_call()
                self._on("text", text)
                return
        self._is_started = True
        if self._had_calls:
            text, self._held = self._held + text, ""
            if not text.strip():
                self._held = text
                return
        self._send(text)

    def _send(self, text: str) -> None:
        self._out.append(text)

    def _begin_markup(self, marker: str) -> None:
        self._had_calls = True
        if self._unclaimed is None:
            self._unclaimed = marker

    def _start_call(self) -> None:
        self._state = _CALL
        self._body = self.fmt.body(self.sink, self.properties)

    def _end_call(self, closed: bool) -> None:
        if self._body is not None:
            self._body.end(closed)
        self._body = None


class _Rest:
    """What follows a body that ended by itself, before its close marker: ignored."""

    def feed(self, text: str) -> str | None:
        return None

    def end(self, closed: bool) -> None:
        pass
