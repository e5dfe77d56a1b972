"""A request's output constraint, from whichever field set it, checked at the edge.

    response_format {json_object | json_schema}   chat
    structured_outputs {json|regex|choice|grammar|json_object}, guided_json / guided_regex /
    guided_choice / guided_grammar                 chat and completions (vLLM's extras)
    tool_choice "required" / a named function      chat: a JSON schema built from the tools
    tool_choice "auto" (--tool-call-grammar)         chat: free text, calls held to the tools (`auto_tool_grammar`)

At most one may be set. The constraint becomes a `GrammarSpec` on the wire; here it is parsed
into a grammar once (no tokenizer needed, cached by spec) so that a bad schema or regex is a 400
naming the field before any byte of the response.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema

from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.tool_parsers.structural import call_grammar_ebnf
from pagedserve.shared.grammar_spec import GrammarSpec, check_spec

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_spec(req: Any) -> tuple[GrammarSpec, str] | None:
    """The request's constraint and the parameter that set it, or None."""
    found = [(spec, param) for spec, param in _candidates(req) if spec is not None]
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise APIError(400, f"only one output constraint may be given, got {names}", param=found[1][1])
    return found[0] if found else None


def check_grammar(req: Any) -> None:
    spec = grammar_spec(req)
    if spec is None:
        return
    error = _check_cached(spec[0])
    if error is not None:
        raise APIError(400, f"Invalid {spec[1]}: {error}", param=spec[1], code="invalid_value")


@functools.lru_cache(maxsize=1024)
def _check_cached(spec: GrammarSpec) -> str | None:
    try:
        if spec.kind == "json":
            _check_json_schema(json.loads(spec.value))
        check_spec(spec)
    except ValueError as exc:
        return str(exc) or "invalid"
    return None


def _check_json_schema(schema: Any) -> None:
    if not isinstance(schema, dict | bool):
        raise ValueError("the schema must be a JSON object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"not a valid JSON schema: {exc.message}") from None


def _candidates(req: Any) -> list[tuple[GrammarSpec | None, str]]:
    out = [
        (_json_spec(req.guided_json, "guided_json"), "guided_json"),
        (None if req.guided_regex is None else GrammarSpec("regex", req.guided_regex), "guided_regex"),
        (None if req.guided_choice is None else _choice(req.guided_choice, "guided_choice"), "guided_choice"),
        (None if req.guided_grammar is None else GrammarSpec("grammar", req.guided_grammar), "guided_grammar"),
    ]
    if req.structured_outputs is not None:
        out.append((_structured_outputs(req.structured_outputs), "structured_outputs"))
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        out.append((_response_format(response_format), "response_format"))
    out.append((tool_grammar(req), "tool_choice"))
    return out


def _json_spec(value: Any, param: str) -> GrammarSpec | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise APIError(
                400, f"{param} must be a JSON schema (an object or a JSON string of one)", param=param
            ) from None
    if not isinstance(value, dict | bool):
        raise APIError(400, f"{param} must be a JSON schema object", param=param)
    return GrammarSpec.json_schema(value)


def _choice(options: list[str], param: str) -> GrammarSpec:
    if not options or not all(options):
        raise APIError(400, f"{param} must be a non-empty list of non-empty strings", param=param)
    return GrammarSpec.choice(options)


def _structured_outputs(so: Any) -> GrammarSpec | None:
    given = [
        name
        for name in ("json_", "regex", "choice", "grammar", "json_object")
        if getattr(so, name) not in (None, False)
    ]
    if len(given) > 1:
        raise APIError(
            400,
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
            param="structured_outputs",
        )
    if not given:
        return None
    kind = given[0]
    if kind == "json_":
        return _json_spec(so.json_, "structured_outputs")
    if kind == "choice":
        return _choice(so.choice, "structured_outputs")
    if kind == "json_object":
        return GrammarSpec("json_object")
    return GrammarSpec(kind, getattr(so, kind))


def _response_format(rf: Any) -> GrammarSpec | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec("json_object")
    if rf.json_schema is None:
        raise APIError(400, "response_format of type json_schema needs json_schema", param="response_format")
    schema = rf.json_schema.schema_
    return GrammarSpec.json_schema(_ANY_OBJECT if schema is None else schema)


# ── tools ─────────────────────────────────────────────────────────────────────────────────
def tool_choice_mode(req: Any) -> str:
    """none | auto | required | named (the default: auto with tools, none without)."""
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if choice is None or choice == "auto":
        return "auto" if tools else "none"  # nothing to call: no parsing either
    if isinstance(choice, str):
        return choice
    return "named"


def tool_grammar(req: Any) -> GrammarSpec | None:
    """tool_choice "required" or a named function: the JSON schema the output must follow."""
    mode = tool_choice_mode(req)
    if mode in ("none", "auto"):
        return None
    tools = req.tools or []
    if not tools:
        raise APIError(400, f"tool_choice '{mode}' needs tools", param="tool_choice")
    if mode == "named":
        name = req.tool_choice.function.name
        function = next((t.function for t in tools if t.function.name == name), None)
        if function is None:
            raise APIError(400, f"tool_choice names function '{name}', which is not in tools", param="tool_choice")
        return GrammarSpec.json_schema(function.parameters or _ANY_OBJECT)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters or _ANY_OBJECT},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return GrammarSpec.json_schema(schema)


def template_tools(req: Any) -> list[dict[str, Any]] | None:
    """The tools as the chat template gets them (HF's `tools=`), or None (none given, or tool_choice none)."""
    if not getattr(req, "tools", None) or tool_choice_mode(req) == "none":
        return None
    return [t.model_dump(exclude_none=True, by_alias=True) for t in req.tools]


def auto_tool_grammar(req: Any, parser: str) -> GrammarSpec | None:
    """tool_choice "auto": the family's structural tag over the tools, where it has one and the request sets
    no other constraint (an invalid tool schema is then a 400 naming it, as for "required")."""
    if tool_choice_mode(req) != "auto" or grammar_spec(req) is not None:
        return None
    tools = template_tools(req) or []
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters")
        try:
            _check_json_schema(_ANY_OBJECT if parameters is None else parameters)
        except ValueError as exc:
            param = f"tools[{i}].function.parameters"
            raise APIError(400, f"Invalid {param}: {exc}", param=param, code="invalid_value") from None
    try:
        ebnf = call_grammar_ebnf(parser, tools, req.parallel_tool_calls)
    except ValueError as exc:
        raise APIError(400, f"Invalid tools: {exc}", param="tools", code="invalid_value") from None
    return None if ebnf is None else GrammarSpec("grammar", ebnf)
