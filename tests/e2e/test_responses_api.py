"""/v1/responses through the real services, read by the official openai client (streamed and not)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import RunningServices

QUESTION = "What is the capital of France?"


def _client(services: RunningServices) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def test_a_response_is_the_chat_answer(services: RunningServices) -> None:
    client = _client(services)
    chat = client.chat.completions.create(
        model=services.model,
        temperature=0,
        max_tokens=12,
        messages=[{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": QUESTION}],
    )
    response = client.responses.create(
        model=services.model, input=QUESTION, instructions="Answer in one word.", temperature=0, max_output_tokens=12
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_a_streamed_response_sends_the_typed_events(services: RunningServices) -> None:
    client = _client(services)
    whole = client.responses.create(
        model=services.model, input=[{"role": "user", "content": QUESTION}], temperature=0, max_output_tokens=4
    )
    kinds, deltas, last = [], [], None
    with client.responses.stream(
        model=services.model, input=[{"role": "user", "content": QUESTION}], temperature=0, max_output_tokens=4
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            last = event
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    # Cut by the 4-token limit: OpenAI ends such a stream with response.incomplete (not .completed).
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert last is not None and last.type == "response.incomplete"
    assert "".join(deltas) == whole.output_text == last.response.output_text


def test_unknown_ids_are_404s_and_other_tools_a_400(services: RunningServices) -> None:
    client = _client(services)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=services.model, input="hi", previous_response_id="resp_unknown")
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_unknown")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=services.model, input="hi", tools=[{"type": "web_search"}])
    assert "tools" in str(bad.value)


def test_a_named_tool_comes_back_as_a_function_call_item_and_its_result_continues_it(services: RunningServices) -> None:
    client = _client(services)
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        }
    ]
    kwargs = dict(
        model=services.model,
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=40,
        store=False,
    )
    response = client.responses.create(**{**kwargs, "store": True})
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)  # the grammar made it parse

    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    with pytest.raises(openai.NotFoundError):  # store=False: nothing kept
        client.responses.retrieve(final.id)

    # The tool's result continues the stored response: the call and its output reach the chat template, after
    # the first prompt (the same tools rendered in it) and its answer.
    answer = client.responses.create(
        model=services.model,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        tools=tools,
        temperature=0,
        max_output_tokens=8,
    )
    assert answer.output and answer.previous_response_id == response.id
    assert answer.usage is not None and response.usage is not None
    assert answer.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens
