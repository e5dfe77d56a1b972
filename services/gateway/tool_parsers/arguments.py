"""A call's arguments as OpenAI wants them (one JSON object, streamed as text fragments), from how a family
writes them: JSON already (`RawArguments`) or one XML element per parameter (`XmlArguments`: GLM-4.5's
<arg_key>/<arg_value>, Qwen3-Coder's <parameter=...>), whose values are typed by the tool's JSON schema.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

GLM_PARAMETER = re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL)
QWEN_PARAMETER = re.compile(r"<parameter=(?P<key>[^>]*)>(?P<value>.*?)</parameter>", re.DOTALL)


class Arguments(Protocol):
    def feed(self, text: str) -> str: ...  # the arguments' next fragment

    def close(self) -> str: ...  # the last fragment


@dataclass(slots=True)
class RawArguments:
    """JSON text, streamed as written, without the whitespace around it (held back until more text follows)."""

    _held: str = ""
    _sent: bool = False

    def feed(self, text: str) -> str:
        text = self._held + text
        if not self._sent:
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body) :]
        self._sent = self._sent or bool(body)
        return body

    def close(self) -> str:
        return "" if self._sent else "{}"  # a call written with no arguments at all


@dataclass(slots=True)
class XmlArguments:
    """Complete parameter elements become `"key": value` pairs of one JSON object as soon as each one ends."""

    pattern: re.Pattern[str]
    properties: dict[str, Any]  # the tool's parameters' "properties" (empty: unknown tool)
    trim_newlines: bool = False  # Qwen3-Coder writes a value on lines of its own
    _text: str = ""
    _done: int = 0  # characters of `_text` consumed by complete parameters
    _num_sent: int = 0

    def feed(self, text: str) -> str:
        self._text += text
        pieces = []
        for match in self.pattern.finditer(self._text, self._done):
            self._done = match.end()
            key, value = match.group("key").strip(), match.group("value")
            if self.trim_newlines:
                value = value.removeprefix("\n").removesuffix("\n")
            else:
                value = value.strip()
            pair = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(self._typed(key, value), ensure_ascii=False)}"
            pieces.append(("{" if self._num_sent == 0 else ", ") + pair)
            self._num_sent += 1
        return "".join(pieces)

    def close(self) -> str:
        return "}" if self._num_sent else "{}"

    def _typed(self, key: str, value: str) -> Any:
        schema = self.properties.get(key)
        kind = schema.get("type") if isinstance(schema, dict) else None
        return typed_value(value, kind)


def typed_value(value: str, kind: Any) -> Any:
    """A parameter written as text, as the JSON value its schema type asks for (text where it fits nothing)."""
    if kind == "string" or (isinstance(kind, list) and "string" in kind and "null" not in kind):
        return value
    for parse in (json.loads, ast.literal_eval):  # literal_eval: Python literals ('a', True, None), never run
        try:
            parsed = parse(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(parsed, float) and not math.isfinite(parsed):
            break  # 1e999: no JSON number
        if parsed is None or isinstance(parsed, bool | int | float | str | list | dict):
            return parsed
    return value


def tool_properties(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each tool's parameter schemas by tool name, from the request's `tools`."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        found[str(function.get("name"))] = properties if isinstance(properties, dict) else {}
    return found
