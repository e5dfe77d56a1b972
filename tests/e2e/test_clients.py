"""Clients beyond the openai SDK, against the live test server (real Redis, real services, SmolLM2):
instructor makes one structured call (a named tool the grammar enforces, parsed into a pydantic model), and
LiteLLM calls `completion` and a streamed `acompletion` that agree."""

from __future__ import annotations

import asyncio
import os

import openai
from pydantic import BaseModel, Field

from tests.conftest import RunningServices

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM would fetch its cost map at import

import instructor
import litellm

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
