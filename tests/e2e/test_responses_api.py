"""/v1/responses through the real services, read by the official openai client (streamed and not)."""

from __future__ import annotations

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


def test_what_is_not_served_here_is_a_clear_400(services: RunningServices) -> None:
    client = _client(services)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=services.model, input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=services.model,
            input="hi",
            tools=[
                {"type": "function", "name": "f", "strict": False, "parameters": {"type": "object", "properties": {}}}
            ],
        )
    assert "tools" in str(err.value)
