"""Tool-call parsers by `--tool-call-parser` name (vLLM's names), each turning a model's text into content
and OpenAI tool calls, streamed or whole:

    tagged.py     the shared streaming core: content and calls between literal markers
    markers.py    splitting streamed text on markers cut anywhere
    bodies.py     a call's inside: JSON objects, or a name then arguments
    arguments.py  arguments as JSON: written so, or XML parameters typed by the tool's schema
    pythonic.py   [f(a=1), g(b=2)]
    harmony.py    gpt-oss's channels (`openai`)
    families.py   each family's markup
    calls.py      OpenAI's delta shape, ids, parallel_tool_calls
"""

from __future__ import annotations

from typing import Any, Protocol

from pagedserve.services.gateway.tool_parsers.arguments import tool_properties
from pagedserve.services.gateway.tool_parsers.calls import CallSink
from pagedserve.services.gateway.tool_parsers.families import FORMATS, REQUIRED
from pagedserve.services.gateway.tool_parsers.harmony import HarmonyParser
from pagedserve.services.gateway.tool_parsers.tagged import TaggedParser, ToolFormat

HARMONY = "openai"
PARSER_NAMES = (*FORMATS, HARMONY)


class ToolParser(Protocol):
    sink: CallSink
    content: str  # all the content sent so far

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]: ...  # (content delta, tool-call deltas)

    def finish(self) -> tuple[str, list[dict[str, Any]]]: ...  # what the output's end settles


def new_parser(name: str, tools: list[dict[str, Any]] | None = None, max_calls: int | None = None) -> ToolParser:
    """A parser for one choice of a request: `name` a PARSER_NAMES entry, or "required" (tool_choice required)."""
    sink, properties = CallSink(max_calls), tool_properties(tools)
    if name == HARMONY:
        return HarmonyParser(properties, sink)
    fmt: ToolFormat = REQUIRED if name == "required" else FORMATS[name]
    return TaggedParser(fmt, properties, sink)


def keeps_special_tokens(name: str) -> bool:
    """Whether the family's markers are special tokens, which the text must then keep (vLLM's adjust_request)."""
    return name == HARMONY or (name in FORMATS and FORMATS[name].keeps_special_tokens)
