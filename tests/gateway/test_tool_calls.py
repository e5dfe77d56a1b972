"""Tool-call parsing (unit tests on scripted model outputs) and how requests map to constraints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedserve.services.gateway import schemas, structured
from pagedserve.services.gateway.tool_calls import ChoiceToolCalls, finish_reason
from pagedserve.services.gateway.validation import validate
from pagedserve.shared.grammar_spec import GrammarSpec
from pagedserve.shared.prompts import chat_prompt_ids, hermes_messages

HERMES_OUTPUT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
    '"celsius", "note": "a } and a \\"quote\\" <tool_call>"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def stream(state: ChoiceToolCalls, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    content, deltas = "", list[dict[str, Any]]()
    for start in range(0, len(text), step):
        piece, calls = state.feed(text[start : start + step])
        content, deltas = content + piece, deltas + calls
    tail, more = state.finish()
    return content + tail, deltas + more


def assemble(deltas: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
        if "id" in delta:
            assert not call["id"] and delta["type"] == "function" and delta["function"]["arguments"] == ""
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        else:
            assert call["id"], "the header (id, type, name) comes before any arguments"
            call["arguments"] += delta["function"]["arguments"]
    return calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_stream_deltas_in_openai_shape(step: int) -> None:
    state = ChoiceToolCalls("hermes")
    content, deltas = stream(state, HERMES_OUTPUT, step)
    assert content == "Let me check.\n"
    calls = assemble(deltas)
    assert [calls[i]["name"] for i in (0, 1)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"])["note"] == 'a } and a "quote" <tool_call>'
    assert json.loads(calls[1]["arguments"]) == {"zone": "UTC"}
    assert finish_reason(state, "stop") == "tool_calls" and finish_reason(state, "length") == "length"


def test_hermes_whole_message_and_plain_text() -> None:
    state = ChoiceToolCalls("hermes")
    state.feed(HERMES_OUTPUT)
    content, calls = state.message()
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    plain = ChoiceToolCalls("hermes")
    content, deltas = stream(plain, "No tools needed: 1 < 2 and <tool is not a tag", 2)
    assert content == "No tools needed: 1 < 2 and <tool is not a tag" and deltas == []
    assert plain.message() == ("No tools needed: 1 < 2 and <tool is not a tag", [])
    broken = ChoiceToolCalls("hermes")
    broken.feed('<tool_call>{"name": "f", "arguments": {"a": ')  # cut off: not a call, so returned as content
    assert broken.message() == ('<tool_call>{"name": "f", "arguments": {"a": ', [])


def test_llama3_json_calls_and_content() -> None:
    state = ChoiceToolCalls("llama3")
    content, deltas = stream(state, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', 4)
    calls = assemble(deltas)
    assert content == "" and calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"]) == {"zone": "CET"}
    prose = ChoiceToolCalls("llama3")
    assert stream(prose, "  The time is noon.", 3) == ("The time is noon.", [])


def test_required_and_named_modes() -> None:
    required = ChoiceToolCalls("required")
    text = '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_time","arguments":{}}]'
    content, deltas = stream(required, text, 5)
    assert content == "" and {i: c["name"] for i, c in assemble(deltas).items()} == {0: "get_weather", 1: "get_time"}
    named = ChoiceToolCalls("named", "get_weather")
    content, deltas = stream(named, '{"city":"Oslo"}', 4)
    assert content == "" and assemble(deltas)[0] == {
        "id": deltas[0]["id"],
        "name": "get_weather",
        "arguments": '{"city":"Oslo"}',
    }


def chat(**fields: Any) -> schemas.ChatCompletionRequest:
    return validate(
        schemas.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    )


def test_request_fields_map_to_one_grammar_spec() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases: list[tuple[dict[str, Any], GrammarSpec, str]] = [
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object"), "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": schema, "strict": True},
                }
            },
            GrammarSpec.json_schema(schema),
            "response_format",
        ),
        ({"guided_json": json.dumps(schema)}, GrammarSpec.json_schema(schema), "guided_json"),
        ({"guided_choice": ["a", "b"]}, GrammarSpec.choice(["a", "b"]), "guided_choice"),
        ({"structured_outputs": {"regex": "a+"}}, GrammarSpec("regex", "a+"), "structured_outputs"),
        ({"structured_outputs": {"json": schema}}, GrammarSpec.json_schema(schema), "structured_outputs"),
    ]
    for fields, spec, param in cases:
        assert structured.grammar_spec(chat(**fields)) == (spec, param)
        assert schemas.sampling_dict(chat(**fields))["structured_output"] == spec.to_wire()
    assert structured.grammar_spec(chat(response_format={"type": "text"})) is None
    assert "structured_output" not in schemas.sampling_dict(chat())


def test_tool_choice_grammars() -> None:
    required = structured.tool_grammar(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert required is not None
    schema = json.loads(required.value)
    assert schema["maxItems"] == 1 and [o["properties"]["name"]["const"] for o in schema["items"]["anyOf"]] == [
        "get_weather",
        "get_time",
    ]
    named = structured.tool_grammar(
        chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    )
    assert named == GrammarSpec.json_schema(TOOLS[0]["function"]["parameters"])
    assert structured.tool_grammar(chat(tools=TOOLS)) is None  # auto: the parser, no grammar
    assert structured.template_tools(chat(tools=TOOLS, tool_choice="none")) is None
    assert structured.template_tools(chat(tools=TOOLS)) == TOOLS


def test_tools_reach_the_template(smollm2_dir: Path) -> None:
    """SmolLM2's template knows no tools: they arrive as a Hermes system prompt, calls as <tool_call> text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    text = tokenizer.decode(chat_prompt_ids(tokenizer, messages, tools=TOOLS))
    assert "<tools>" in text and '"get_weather"' in text and '<tool_call>\n{"name": "get_weather"' in text
    assert text == tokenizer.decode(chat_prompt_ids(tokenizer, hermes_messages(messages, TOOLS)))
    without = tokenizer.decode(chat_prompt_ids(tokenizer, messages[:1]))
    assert "<tools>" not in without
