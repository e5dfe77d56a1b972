"""Real clients against the live test server (real Redis, real services, SmolLM2): the openai SDK's parse helpers
and its Responses API (create, stream, previous_response_id, retrieve, delete); langchain-openai's invoke, stream,
bind_tools and with_structured_output; instructor makes one structured call (a named tool the grammar enforces,
parsed into a pydantic model); LiteLLM calls `completion` and a streamed `acompletion` that agree."""

from __future__ import annotations

import asyncio
import os

import openai
from pydantic import BaseModel, Field

from tests.conftest import RunningServices

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its cost map at import

import instructor
import litellm
import pytest
from langchain_openai import ChatOpenAI

MESSAGES = [{"role": "user", "content": "Name a city in France."}]


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


def test_instructor_makes_a_structured_call(services: RunningServices) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300),
        mode=instructor.Mode.TOOLS,
    )
    city = client.chat.completions.create(
        model=services.model, response_model=City, messages=MESSAGES, max_tokens=96, temperature=0, max_retries=0
    )
    assert isinstance(city, City) and city.name and city.country


def test_litellm_completion_and_a_streamed_acompletion_agree(services: RunningServices) -> None:
    common = dict(
        model=f"openai/{services.model}",
        api_base=f"{services.base_url}/v1",
        api_key="x",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
    )
    whole = litellm.completion(**common)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0

    async def streamed() -> str:
        parts = []
        async for chunk in await litellm.acompletion(**common, stream=True):
            parts.append(chunk.choices[0].delta.content or "")
        return "".join(parts)

    assert asyncio.run(streamed()) == text


def _openai(services: RunningServices) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def test_openai_parse_fills_a_pydantic_model(services: RunningServices) -> None:
    completion = _openai(services).chat.completions.parse(
        model=services.model, messages=MESSAGES, response_format=City, max_tokens=48, temperature=0
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country


def test_openai_responses_are_stored_continued_streamed_and_deleted(services: RunningServices) -> None:
    client = _openai(services)
    first = client.responses.create(
        model=services.model, input="My name is Ana.", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert client.responses.retrieve(first.id) == first  # stored: store defaults to true
    assert first.usage is not None

    # The stored conversation (input and output) comes before the new input: the prompt grew by all of it.
    with client.responses.stream(
        model=services.model,
        input="Name a city in France.",
        previous_response_id=first.id,
        text_format=City,  # a grammar-bound answer ends well within max_output_tokens: response.completed
        max_output_tokens=48,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        second = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert isinstance(second.output_parsed, City) and second.previous_response_id == first.id
    assert second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    # its input items, newest first: the new question, then the first response's answer and its input
    items = client.responses.input_items.list(second.id, limit=3)
    assert [item.type for item in items.data] == ["message"] * 3 and items.has_more is False
    assert [getattr(item, "role", None) for item in items.data] == ["user", "assistant", "user"]

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=services.model, input="And mine?", previous_response_id=first.id)


def _langchain(services: RunningServices, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(
        model=services.model,
        base_url=f"{services.base_url}/v1",
        api_key="x",
        temperature=0,
        max_tokens=max_tokens,  # type: ignore[call-arg]
        max_retries=0,
        timeout=300,
    )


def test_langchain_invoke_and_stream_agree(services: RunningServices) -> None:
    llm = _langchain(services, max_tokens=12)
    whole = llm.invoke(MESSAGES)
    assert isinstance(whole.content, str) and whole.content
    assert "".join(str(chunk.content) for chunk in llm.stream(MESSAGES)) == whole.content


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=24)


def test_langchain_tools_and_structured_output(services: RunningServices) -> None:
    llm = _langchain(services, max_tokens=48)
    message = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "GetWeather" and isinstance(call["args"]["city"], str)
    city = llm.with_structured_output(City).invoke(MESSAGES)
    assert isinstance(city, City) and city.name and city.country
