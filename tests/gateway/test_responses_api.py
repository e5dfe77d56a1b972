"""/v1/responses: requests become the chat request the pipeline serves; output items and their stream events."""

from __future__ import annotations

from typing import Any

import pytest

from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.response_items import input_items, item_page
from pagedserve.services.gateway.response_output import OutputItems
from pagedserve.services.gateway.responses_api import ResponsesRequest, chat_request_of
from pagedserve.services.gateway.schemas import ChatCompletionRequest, NamedToolChoice

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    req = ResponsesRequest.model_validate({"model": "m", **body})
    return chat_request_of(req, (history or []) + input_items(req.input))


def test_input_and_instructions_become_chat_messages() -> None:
    chat = _chat(
        {
            "instructions": "Be brief.",
            "max_output_tokens": 7,
            "temperature": 0.3,
            "reasoning": {"effort": "low"},
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hel"}, {"type": "input_text", "text": "lo"}],
                },
                {"type": "message", "role": "assistant", "content": "Hi"},
                {"role": "user", "content": "Paris?"},
            ],
        }
    )
    assert [m.as_template_input() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Paris?"},
    ]
    assert (chat.token_budget, chat.temperature, chat.reasoning_effort) == (7, 0.3, "low")
    plain = _chat({"input": "Paris?"})
    assert [m.as_template_input() for m in plain.messages] == [{"role": "user", "content": "Paris?"}]


def test_history_tool_calls_and_results_become_chat_messages() -> None:
    history = [  # a stored response's input and output items: reasoning is dropped, calls join their message
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city":"Paris"}'},
    ]
    chat = _chat(
        {
            "input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
            "tools": [{"type": "function", "name": "weather", "parameters": WEATHER, "strict": True}],
            "tool_choice": {"type": "function", "name": "weather"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}},
        },
        history,
    )
    assert [m.as_template_input() for m in chat.messages] == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert chat.tools is not None and chat.response_format is not None and chat.response_format.json_schema
    assert chat.tools[0].function.name == "weather" and chat.tools[0].function.parameters == WEATHER
    assert (
        isinstance(chat.tool_choice, NamedToolChoice)
        and chat.tool_choice.function.name == "weather"
        and chat.parallel_tool_calls is False
    )
    assert chat.response_format.json_schema.schema_ == WEATHER


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [{"type": "web_search"}]},  # only function tools are served
        {"input": [{"type": "function_call_output", "output": "x"}]},  # no call_id
        {"input": [{"role": "robot", "content": "hi"}]},
    ],
)
def test_what_is_not_served_is_refused(fields: dict[str, object]) -> None:
    from pagedserve.services.gateway.validation import validate

    with pytest.raises(APIError) as err:
        validate(ResponsesRequest, {"model": "m", "input": "hi", **fields})
    assert err.value.status == 400


def test_items_stream_their_events_in_openai_order() -> None:
    output = OutputItems()
    events = output.reasoning("Paris is ") + output.reasoning("in France.") + output.text("Calling.")
    events += output.tool_call({"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather"}})
    events += output.tool_call({"index": 0, "function": {"arguments": '{"city":'}})
    events += output.tool_call({"index": 0, "function": {"arguments": '"Paris"}'}})
    events += output.close()
    assert [kind for kind, _ in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [fields.get("output_index") for _, fields in events] == [0] * 7 + [1] * 6 + [2] * 5
    reasoning, message, call = output.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Paris is in France."}]
    assert message["content"][0]["text"] == output.output_text == "Calling."
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "weather", '{"city":"Paris"}')
    assert events[-2][1] == {
        "item_id": call["id"],
        "output_index": 2,
        "name": "weather",
        "arguments": call["arguments"],
    }
    assert all(item["status"] == "completed" for item in output.items)
    assert output.close() == []  # nothing open


def test_input_items_get_ids_and_list_in_pages() -> None:
    req = ResponsesRequest.model_validate(
        {"model": "m", "input": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "id": "m2"}]}
    )
    first, second = input_items(req.input)
    assert first["id"].startswith("msg_") and first["content"] == [{"type": "input_text", "text": "a"}]
    assert second["id"] == "m2" and second["content"] == [{"type": "output_text", "text": "b"}]
    (plain,) = input_items("hi")
    assert (plain["role"], plain["content"]) == ("user", [{"type": "input_text", "text": "hi"}])

    items = [{"id": f"i{n}"} for n in range(5)]
    page = item_page(items, after=None, limit=2, order="desc")
    assert ([i["id"] for i in page["data"]], page["first_id"], page["last_id"], page["has_more"]) == (
        ["i4", "i3"],
        "i4",
        "i3",
        True,
    )
    rest = item_page(items, after="i1", limit=20, order="asc")
    assert [i["id"] for i in rest["data"]] == ["i2", "i3", "i4"] and rest["has_more"] is False
