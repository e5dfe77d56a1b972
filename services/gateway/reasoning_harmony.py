"""gpt-oss's harmony format, split as it streams: the analysis channel is reasoning, the rest is the answer.

    <|channel|>analysis<|message|>We need ...<|end|><|start|>assistant<|channel|>final<|message|>Paris.
    └───── header ────┘└────── reasoning ──────┘└──────────────── header ─────────────┘└ content ┘

The prompt ends with `<|start|>assistant`, so an output opens with `<|channel|>`. The markers are special
tokens: the gateway detokenizes with them kept (ReasoningFormat.keeps_special_tokens). A commentary-channel
message (a tool call, `to=functions.x`) goes to the content whole, markers included, so a harmony tool-call
parser after this one still sees it; text with no markers at all (a model that does not write harmony) is
all content.
"""

from __future__ import annotations

import re

_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
_MARKER = re.compile("|".join(re.escape(m) for m in _MARKERS))
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_OUTSIDE, _HEADER, _BODY = "outside", "header", "body"


class HarmonySplitter:
    """One choice's harmony text: `feed` returns (reasoning, content) ready to send (as ReasoningSplitter)."""

    def __init__(self) -> None:
        self.state = _OUTSIDE
        self.pending = ""  # held back: may be the start of a marker
        self.header = ""  # the header being read (its markers included)
        self.channel = ""  # the channel of the message whose body is being read
        self.has_markup = False
        self.has_answer = False
        self._reasoning: list[str] = []
        self._content: list[str] = []

    @property
    def is_answering(self) -> bool:
        return self.has_answer

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        while (found := _MARKER.search(self.pending)) is not None:
            self._text(self.pending[: found.start()])
            self._marker(found.group(0))
            self.pending = self.pending[found.end() :]
        keep = _partial_marker(self.pending)
        self._text(self.pending[: len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep :]
        return self._take()

    def flush(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        self._text(rest)
        return self._take()

    def _take(self) -> tuple[str, str]:
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        self._reasoning.clear()
        self._content.clear()
        return reasoning, content

    def _answer(self, text: str) -> None:
        if text:
            self.has_answer = True
            self._content.append(text)

    def _text(self, text: str) -> None:
        if not text:
            return
        if self.state == _HEADER:
            self.header += text
        elif self.state == _BODY and self.channel == "analysis":
            self._reasoning.append(text)
        elif self.state == _BODY or not (self.has_markup and text.isspace()):  # nothing between messages
            self._answer(text)

    def _marker(self, marker: str) -> None:
        self.has_markup = True
        if marker in ("<|start|>", "<|channel|>") and self.state != _HEADER:
            self.state, self.header = _HEADER, marker
        elif self.state == _HEADER and marker != "<|message|>":
            self.header += marker  # <|channel|> after <|start|>role, <|constrain|>
        elif marker == "<|message|>":
            found = _CHANNEL.search(self.header) if self.state == _HEADER else None
            self.channel = found.group(1) if found else "final"
            self.state = _BODY
            if self.channel not in ("analysis", "final"):
                self._answer(self.header + marker)  # commentary: whole, for a tool-call parser
        elif self.state == _BODY and marker in ("<|end|>", "<|return|>", "<|call|>"):
            if self.channel not in ("analysis", "final"):
                self._answer(marker)
            self.state = _OUTSIDE
        elif self.state == _BODY:
            self._text(marker)  # a marker with no meaning here is text of the message


def _partial_marker(text: str) -> int:
    """How many trailing characters of `text` could be the start of a marker."""
    for size in range(min(len(max(_MARKERS, key=len)) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in _MARKERS):
            return size
    return 0
