"""Tool calls out of generated text, in OpenAI's shape, for each way a request can call tools.

    named     tool_choice names a function: the whole output is its arguments (grammar-enforced)
    required  the output is a JSON array [{"name", "arguments"}, ...] (grammar-enforced)
    auto      the model's own format, read by the `--tool-call-parser` family (tool_parsers/)

`ChoiceToolCalls.feed` turns each text delta into (content delta, tool-call deltas) for a stream;
`finish` settles the end; `message` gives the non-streaming message from the same parse. Auto-mode output
whose calls are broken (cut off, arguments that are not a JSON object) is returned as plain content, never
a half-parsed call, when not streaming. With parallel_tool_calls false only the first call is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pagedserve.services.gateway.detokenizer import TextOptions
from pagedserve.services.gateway.tool_parsers import ToolParser, keeps_special_tokens, new_parser
from pagedserve.services.gateway.tool_parsers.calls import new_call_id

__all__ = ["ChoiceToolCalls", "finish_reason", "new_call_id", "text_options", "tool_call_states"]


@dataclass(slots=True)
class ChoiceToolCalls:
    mode: str  # named | required | a --tool-call-parser name
    function_name: str | None = None  # named mode
    tools: list[dict[str, Any]] | None = None  # the request's tools (XML families type their arguments by them)
    max_calls: int | None = None  # parallel_tool_calls false: 1
    text: str = ""  # everything generated so far
    _parser: ToolParser | None = None
    _named_id: str | None = None

    def __post_init__(self) -> None:
        if self.mode != "named":
            self._parser = new_parser(self.mode, self.tools, self.max_calls)

    # ── streaming ──────────────────────────────────────────────────────────────────────────
    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        if self._parser is None:
            return "", self._named_deltas(delta)
        return self._parser.feed(delta)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end: held-back text that turned out to be content, and the last argument fragments."""
        return ("", []) if self._parser is None else self._parser.finish()

    @property
    def has_calls(self) -> bool:
        return self._named_id is not None if self._parser is None else bool(self._parser.sink.calls)

    def _named_deltas(self, delta: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self._named_id is None:
            self._named_id = new_call_id()
            header = {"name": self.function_name or "", "arguments": ""}
            deltas.append({"index": 0, "id": self._named_id, "type": "function", "function": header})
        if delta:
            deltas.append({"index": 0, "function": {"arguments": delta}})
        return deltas

    # ── whole answers ──────────────────────────────────────────────────────────────────────
    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) for a non-streaming answer, from all the text fed so far."""
        if self._parser is None:
            function = {"name": self.function_name or "", "arguments": self.text}
            return None, [{"id": new_call_id(), "type": "function", "function": function}]
        self._parser.finish()
        sink = self._parser.sink
        if self.mode == "required":  # grammar-made: what parsed is the answer
            calls = [c for c in sink.calls if c.name]
            return None, [c.as_message() for c in calls]
        if not sink.calls or sink.is_broken or not all(c.is_valid for c in sink.calls):
            return self.text, []  # auto: no (well-formed) call, so it was an ordinary answer
        return (self._parser.content.strip() or None), [c.as_message() for c in sink.calls]


def tool_call_states(
    mode: str,
    function_name: str | None,
    parser: str,
    num_choices: int,
    tools: list[dict[str, Any]] | None = None,
    parallel_tool_calls: bool | None = None,
) -> list[ChoiceToolCalls] | None:
    """One parser per choice for a request's tool_choice mode (none/auto/required/named), or None."""
    if mode == "none":
        return None
    kind = parser if mode == "auto" else mode
    max_calls = 1 if parallel_tool_calls is False else None
    return [ChoiceToolCalls(kind, function_name, tools, max_calls) for _ in range(num_choices)]


def text_options(mode: str, parser: str, options: TextOptions) -> TextOptions:
    """A family whose markers are special tokens needs them in the text to see its calls (as vLLM does)."""
    if mode == "auto" and keeps_special_tokens(parser):
        return replace(options, skip_special_tokens=False)
    return options


def finish_reason(state: ChoiceToolCalls, reason: str | None) -> str | None:
    """A choice that called tools and ended normally finishes with "tool_calls"."""
    return "tool_calls" if reason == "stop" and state.has_calls else reason
