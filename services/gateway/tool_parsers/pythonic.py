"""Pythonic calls (Llama-3.2/4, `pythonic` and `llama4_pythonic`): a Python list of keyword calls,
`[get_weather(city="Paris"), get_time(zone='UTC')]`. Each call goes out whole once its parenthesis closes;
its arguments are read with `ast` (literals only, nothing is evaluated) and sent as JSON.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any

from pagedserve.services.gateway.tool_parsers.calls import CallSink

_JSON_NAMES = {"true": True, "false": False, "null": None}  # models that mix JSON into Python


@dataclass(slots=True)
class PythonicCalls:
    sink: CallSink
    _element: str = ""  # the list element being read
    _depth: int = 0  # brackets open, the list's own included
    _quote: str = ""  # inside a string: its quote
    _escape: bool = False
    _is_done: bool = False

    def feed(self, text: str) -> str | None:
        for at, c in enumerate(text):
            if self._is_done:
                return text[at:]
            self._char(c)
        return "" if self._is_done else None

    def _char(self, c: str) -> None:
        if self._depth >= 1:
            self._element += c
        if self._quote:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == self._quote:
                self._quote = ""
        elif c in "'\"":
            self._quote = c
        elif c in "([{":
            self._depth += 1
        elif c in ")]}":
            self._depth -= 1
            if self._depth == 1 and c == ")":
                self._emit(self._element)
                self._element = ""
            elif self._depth == 0:
                self._is_done = True
                self._element = self._element[:-1]  # the list's "]"
        elif c == "," and self._depth == 1:
            self._element = ""

    def _emit(self, source: str) -> None:
        parsed = parse_call(source.strip().lstrip(","))
        if parsed is None:
            self.sink.is_broken = True
            return
        name, arguments = parsed
        self.sink.open(name)
        self.sink.arguments(json.dumps(arguments, ensure_ascii=False))
        self.sink.close()

    def end(self, closed: bool) -> None:
        if self._element.strip() or (self._depth and not self._is_done and not closed):
            self.sink.is_broken = True  # a call or the list left open


def parse_call(source: str) -> tuple[str, dict[str, Any]] | None:
    """`name(key=literal, ...)` as (name, arguments), or None when it is not one."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or node.args or not all(k.arg for k in node.keywords):
        return None
    name = ast.unparse(node.func)
    if not all(part.isidentifier() for part in name.split(".")):
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        try:
            arguments[str(keyword.arg)] = _literal(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return name, arguments


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k) if k is not None else None: _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)
