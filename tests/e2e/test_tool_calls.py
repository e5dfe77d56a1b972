"""Tool calling through the whole pipeline with the `openai` client on the default model:
tool_choice "required" and a named function are grammar-enforced (so they work on SmolLM2),
streaming and not; "auto" gives a well-formed answer whichever way the model goes; assistant
tool_calls and tool results in the history are accepted."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import RunningServices

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(services: RunningServices) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def collect_stream(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    content, finish = "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                if part.id:
                    assert not call["id"], "the id comes once, in the call's first delta"
                    call["id"] = part.id
                    assert part.type == "function" and part.function.name
                    call["name"] = part.function.name
                call["arguments"] += part.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls(client: openai.OpenAI, services: RunningServices, parallel: bool) -> None:
    # Sampled parallel calls may go on adding calls past any budget: greedy there, sampled for one call.
    reply = client.chat.completions.create(
        model=services.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        temperature=0.0 if parallel else 1.0,
        seed=2,
        max_tokens=300,
        parallel_tool_calls=parallel,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    if not parallel:
        assert len(choice.message.tool_calls) == 1


def test_named_function_returns_its_call(client: openai.OpenAI, services: RunningServices) -> None:
    reply = client.chat.completions.create(
        model=services.model,
        messages=MESSAGES,
        tools=TOOLS,
        temperature=1.0,
        seed=3,
        max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather"})


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas(client: openai.OpenAI, services: RunningServices, tool_choice: Any) -> None:
    stream = client.chat.completions.create(
        model=services.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=1.0,
        seed=4,
        max_tokens=200,
        stream=True,
        parallel_tool_calls=False,
    )
    content, calls, finish = collect_stream(stream)
    assert content == "" and finish == "tool_calls" and list(calls) == [0]  # parallel_tool_calls false: one call
    names = {"get_time"} if isinstance(tool_choice, dict) else set(PARAMS)
    for call in calls.values():
        assert call["id"].startswith("call_") and call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


def test_auto_is_well_formed_either_way(client: openai.OpenAI, services: RunningServices) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "user", "content": "And in Rome?"},
    ]
    for messages in (MESSAGES, history):
        reply = client.chat.completions.create(
            model=services.model, messages=messages, tools=TOOLS, temperature=1.0, seed=5, max_tokens=64
        )
        choice = reply.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                assert call.function.name and isinstance(json.loads(call.function.arguments), dict)
        else:
            assert choice.message.content is not None and choice.finish_reason in ("stop", "length")
    _, calls, finish = collect_stream(
        client.chat.completions.create(
            model=services.model,
            messages=history,
            tools=TOOLS,
            temperature=1.0,
            seed=6,
            max_tokens=64,
            stream=True,
        )
    )
    assert finish in ("stop", "length", "tool_calls") and (finish != "tool_calls" or bool(calls))


def test_auto_with_a_broken_tool_schema_is_a_400(client: openai.OpenAI, services: RunningServices) -> None:
    """Under "auto" the calls are held to the tools' schemas by a grammar (--tool-call-grammar), so a schema
    that is none is refused before any byte, naming it; the server answers the next request as usual."""
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=services.model, messages=MESSAGES, tools=bad, max_tokens=4, stream=True)
    assert err.value.body["param"] == "tools[0].function.parameters"  # type: ignore[index]
    reply = client.chat.completions.create(model=services.model, messages=MESSAGES, tools=TOOLS, max_tokens=4)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_legacy_functions_get_a_function_call(client: openai.OpenAI, services: RunningServices) -> None:
    """OpenAI's legacy function calling (older agent code): functions/function_call in, message.function_call
    out, and a function-role result accepted back into the conversation."""
    functions = [tool["function"] for tool in TOOLS]
    reply = client.chat.completions.create(
        model=services.model,
        messages=MESSAGES,
        functions=functions,
        function_call={"name": "get_weather"},
        temperature=1.0,
        seed=3,
        max_tokens=120,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    call = choice.message.function_call
    assert call is not None and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": None, "function_call": {"name": call.name, "arguments": call.arguments}},
        {"role": "function", "name": "get_weather", "content": "22 C, sunny"},
    ]
    answer = client.chat.completions.create(
        model=services.model, messages=follow_up, max_tokens=8, temperature=0, functions=functions
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "function_call")


def test_legacy_functions_stream_a_function_call(client: openai.OpenAI, services: RunningServices) -> None:
    functions = [tool["function"] for tool in TOOLS]
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(
        model=services.model,
        messages=MESSAGES,
        functions=functions,
        function_call={"name": "get_weather"},
        temperature=1.0,
        seed=3,
        max_tokens=120,
        stream=True,
    ):
        for choice in chunk.choices:
            assert not choice.delta.tool_calls  # the legacy shape only
            if choice.delta.function_call is not None:
                name += choice.delta.function_call.name or ""
                arguments += choice.delta.function_call.arguments or ""
            finish = choice.finish_reason or finish
    assert (name, finish) == ("get_weather", "function_call")
    jsonschema.validate(json.loads(arguments), WEATHER)
