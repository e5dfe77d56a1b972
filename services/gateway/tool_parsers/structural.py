"""tool_choice "auto" under a grammar: an xgrammar structural tag triggered by the family's call marker.

Text stays free until the model writes the trigger (`<tool_call>`); from there the call must name one of
the tools and its arguments must match that tool's schema, then text is free again. The tag is turned into
EBNF here, so the engine compiles it as any other grammar. Only families whose markers are plain text have a
tag: a special-token marker is one token the grammar cannot spell.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CallTag:
    trigger: str
    begin: str  # "{name}" stands for the tool's name (JSON-quoted where `quote_name`)
    end: str
    quote_name: bool = True
    xml_arguments: bool = False  # Qwen3-Coder's <parameter=...> elements instead of a JSON object


CALL_TAGS = {
    "hermes": CallTag("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"),
    "qwen3_coder": CallTag(
        "<tool_call>", "<tool_call>\n<function={name}>\n", "</function>\n</tool_call>", False, xml_arguments=True
    ),
}


def call_grammar_ebnf(parser: str, tools: list[dict[str, Any]], parallel_tool_calls: bool | None) -> str | None:
    """The EBNF of free text with grammar-checked calls, or None where the family has no tag (or no tools).
    ValueError for a tool whose parameters are no usable JSON schema."""
    if parser not in CALL_TAGS or not tools:
        return None
    functions = tuple(
        (str(t["function"]["name"]), json.dumps(t["function"].get("parameters") or {"type": "object"})) for t in tools
    )
    return _ebnf(parser, functions, parallel_tool_calls is False)


@functools.lru_cache(maxsize=256)
def _ebnf(parser: str, functions: tuple[tuple[str, str], ...], only_one: bool) -> str:
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    tag = CALL_TAGS[parser]
    tags = []
    for name, schema in functions:
        content = (
            st.QwenXMLParameterFormat(json_schema=json.loads(schema))
            if tag.xml_arguments
            else st.JSONSchemaFormat(json_schema=json.loads(schema))
        )
        shown = json.dumps(name, ensure_ascii=False) if tag.quote_name else name
        tags.append(st.TagFormat(begin=tag.begin.format(name=shown), content=content, end=tag.end))
    triggered = st.TriggeredTagsFormat(triggers=[tag.trigger], tags=tags, at_least_one=False, stop_after_first=only_one)
    try:
        return str(xgr.Grammar.from_structural_tag(st.StructuralTag(format=triggered)))
    except Exception as exc:  # xgrammar's own error types for schemas it cannot use
        raise ValueError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
