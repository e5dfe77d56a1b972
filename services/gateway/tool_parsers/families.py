"""Each `--tool-call-parser` family as a few lines of markup, after vLLM's parsers and the models' templates.
The names are vLLM's; `llama3` is our older name for `llama3_json`.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from typing import Any

from pagedserve.services.gateway.tool_parsers.arguments import (
    GLM_PARAMETER,
    QWEN_PARAMETER,
    Arguments,
    RawArguments,
    XmlArguments,
)
from pagedserve.services.gateway.tool_parsers.bodies import Body, FirstChar, JsonCalls, NamedCall
from pagedserve.services.gateway.tool_parsers.calls import CallSink
from pagedserve.services.gateway.tool_parsers.pythonic import PythonicCalls
from pagedserve.services.gateway.tool_parsers.tagged import ToolFormat

Properties = dict[str, dict[str, Any]]


def json_calls(sink: CallSink, properties: Properties) -> Body:
    return JsonCalls(sink)


def pythonic_calls(sink: CallSink, properties: Properties) -> Body:
    return PythonicCalls(sink)


def named(
    pattern: str,
    xml: re.Pattern[str] | None = None,
    trim_newlines: bool = False,
    name_of: Callable[[str], str] = str.strip,
    id_of: Callable[[str], str | None] = lambda raw: None,
) -> Callable[[CallSink, Properties], NamedCall]:
    """A call written NAME <pattern's end> ARGUMENTS: JSON, or XML parameters when `xml` is given."""
    name_pattern = re.compile(pattern, re.DOTALL)

    def body(sink: CallSink, properties: Properties) -> NamedCall:
        def arguments(name: str) -> Arguments:
            if xml is None:
                return RawArguments()
            return XmlArguments(xml, properties.get(name, {}), trim_newlines)

        return NamedCall(sink, name_pattern, arguments, name_of, id_of)

    return body


def mistral_id(raw: str) -> str:
    """Mistral's templates accept only 9 alphanumeric characters as a call id."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def mistral_calls(sink: CallSink, properties: Properties) -> Body:
    """`[TOOL_CALLS][{"name": ..., "arguments": ...}]` (before v11) or `[TOOL_CALLS]name[ARGS]{...}` / `name{...}`."""
    call = named(r"\s*(?P<name>[^\s\[{]+)\s*(?:\[ARGS\]|(?=\{))", id_of=mistral_id)
    return FirstChar(lambda c: JsonCalls(sink) if c in "[{" else call(sink, properties))


DEEPSEEK_BLOCK = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_OPEN = ("<｜tool▁call▁begin｜>",)

FORMATS: dict[str, ToolFormat] = {
    # <tool_call>{"name": "f", "arguments": {...}}</tool_call>  (Qwen2.5, Hermes, SmolLM2 through our prompt)
    "hermes": ToolFormat(json_calls, opens=("<tool_call>",), closes=("</tool_call>",), keeps_special_tokens=False),
    # {"name": "f", "parameters": {...}}; {...}   (Llama 3.1/3.2 JSON; after <|python_tag|> too)
    "llama3_json": ToolFormat(json_calls, opens=("<|python_tag|>",), at_start="{"),
    # [f(a=1), g(b="x")]   (Llama 3.2, ToolACE, ...)
    "pythonic": ToolFormat(pythonic_calls, at_start="[", keeps_special_tokens=False),
    # <|python_start|>[f(a=1)]<|python_end|>, or the bare list   (Llama 4)
    "llama4_pythonic": ToolFormat(
        pythonic_calls, opens=("<|python_start|>",), closes=("<|python_end|>",), at_start="["
    ),
    "mistral": ToolFormat(mistral_calls, opens=("[TOOL_CALLS]",)),
    # <tool_call>\n<function=f>\n<parameter=a>\nvalue\n</parameter>\n</function>\n</tool_call>
    "qwen3_coder": ToolFormat(
        named(r"\s*<function=(?P<name>[^>\n]+)>", QWEN_PARAMETER, trim_newlines=True),
        opens=("<tool_call>",),
        closes=("</tool_call>",),
        keeps_special_tokens=False,
    ),
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{...}\n```<｜tool▁call▁end｜>...
    "deepseek_v3": ToolFormat(
        named(r"(?:[^<\n]*<｜tool▁sep｜>)?(?P<name>[^\n]+)\n```json\n"),
        opens=DEEPSEEK_OPEN,
        closes=("\n```<｜tool▁call▁end｜>", "```<｜tool▁call▁end｜>", "<｜tool▁call▁end｜>"),
        block=DEEPSEEK_BLOCK,
    ),
    # <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    "deepseek_v31": ToolFormat(
        named(r"(?P<name>[^<]*)<｜tool▁sep｜>"),
        opens=DEEPSEEK_OPEN,
        closes=("<｜tool▁call▁end｜>",),
        block=DEEPSEEK_BLOCK,
    ),
    # <|tool_call|>[{"name": "f", "arguments": {...}}]  (Granite 3.0; 3.1+ write <tool_call>)
    "granite": ToolFormat(json_calls, opens=("<|tool_call|>", "<tool_call>")),
    # functools[{"name": "f", "arguments": {...}}]
    "phi4_mini_json": ToolFormat(json_calls, opens=("functools[",), keeps_special_tokens=False),
    # <tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>
    "glm45": ToolFormat(
        named(r"(?P<name>[^\n<]*)(?:\n|(?=<arg_key>))", GLM_PARAMETER), opens=("<tool_call>",), closes=("</tool_call>",)
    ),
    # <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}<|tool_call_end|>
    "kimi_k2": ToolFormat(
        named(
            r"\s*(?P<name>[^<]+?)\s*<\|tool_call_argument_begin\|>",
            name_of=lambda raw: raw.strip().split(":")[0].split(".")[-1],
            id_of=str.strip,  # functions.f:0: Kimi's template reads the index back from the id
        ),
        opens=("<|tool_call_begin|>",),
        closes=("<|tool_call_end|>",),
        block=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    ),
}
FORMATS["llama3"] = FORMATS["llama3_json"]

# tool_choice "required": a JSON array of {"name", "arguments"} that the grammar enforces
REQUIRED = ToolFormat(json_calls, at_start="[", keeps_special_tokens=False)
