"""The whole pipeline with the official `openai` client: gateway, tokenizer, engine, Redis, real model."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import E2E_MAX_MODEL_LEN, RunningServices

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(services: RunningServices) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def test_capital_of_france_non_streaming_and_streaming_agree(
    client: openai.OpenAI, services: RunningServices, tokenizer: Any
) -> None:
    reply = client.chat.completions.create(model=services.model, messages=QUESTION, temperature=0, logprobs=True)
    text = reply.choices[0].message.content
    assert text is not None and "Paris" in text
    assert reply.choices[0].finish_reason == "stop"
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")

    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content is not None
    assert reply.usage.completion_tokens == len(reply.choices[0].logprobs.content)  # one logprob per token
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    stream = client.chat.completions.create(
        model=services.model, messages=QUESTION, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1, "the answer should arrive in several chunks"
    assert "".join(deltas) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (reply.usage.prompt_tokens, reply.usage.completion_tokens)


PROMPTS = [
    "Name a color.",
    "What is 2+2?",
    "Say hello in French.",
    "Name a planet.",
    "What is water made of?",
    "Name a fruit.",
    "What day comes after Monday?",
    "Give me a synonym for happy.",
    "What is the opposite of hot?",
    "Name an ocean.",
    "How many legs does a spider have?",
    "Name a musical instrument.",
    "What color is the sky?",
    "Write one word about winter.",
    "Name a programming language.",
    "What is the largest animal?",
]


def test_sixteen_concurrent_streams_match_their_sequential_answers(services: RunningServices) -> None:
    base_url = f"{services.base_url}/v1"

    async def ask(client: openai.AsyncOpenAI, prompt: str, stream: bool) -> str:
        messages = [{"role": "user", "content": prompt}]
        if not stream:
            r = await client.chat.completions.create(
                model=services.model, messages=messages, temperature=0, max_tokens=20
            )
            return r.choices[0].message.content or ""
        parts: list[str] = []
        async for chunk in await client.chat.completions.create(
            model=services.model, messages=messages, temperature=0, max_tokens=20, stream=True
        ):
            parts.extend(c.delta.content or "" for c in chunk.choices)
        return "".join(parts)

    async def go() -> tuple[list[str], list[str]]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=600) as client:
            sequential = [await ask(client, p, stream=False) for p in PROMPTS]
            concurrent = await asyncio.gather(*(ask(client, p, stream=True) for p in PROMPTS))
        return sequential, list(concurrent)

    sequential, concurrent = asyncio.run(go())
    assert all(sequential), "every prompt should get an answer"
    assert len(set(sequential)) > 8, "different prompts should give different answers"
    assert concurrent == sequential


def test_too_long_prompt_is_a_400_before_any_sse_byte_and_unknown_model_a_404(
    client: openai.OpenAI, services: RunningServices
) -> None:
    long_prompt = "hello " * (E2E_MAX_MODEL_LEN + 100)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=services.model, messages=[{"role": "user", "content": long_prompt}], stream=True
        )
    assert err.value.status_code == 400
    assert err.value.code == "context_length_exceeded"
    assert err.value.body["param"] == "messages"  # type: ignore[index]

    raw = httpx.post(
        f"{services.base_url}/v1/chat/completions",
        timeout=60,
        json={
            "model": services.model,
            "messages": [{"role": "user", "content": long_prompt}],
            "stream": True,
        },
    )
    assert raw.status_code == 400 and raw.headers["content-type"].startswith("application/json")
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}

    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert not_found.value.code == "model_not_found"

    after = client.chat.completions.create(model=services.model, messages=QUESTION, temperature=0, max_tokens=12)
    assert "Paris" in (after.choices[0].message.content or "")


def test_max_tokens_exactly_at_the_limit_works_and_one_over_fails(
    client: openai.OpenAI, services: RunningServices
) -> None:
    prompt = [1] * 100  # token ids, so the prompt length is exact
    with client.completions.create(
        model=services.model, prompt=prompt, max_tokens=E2E_MAX_MODEL_LEN - 100, temperature=0, stream=True
    ) as stream:
        first = next(iter(stream))  # accepted: headers and a first chunk came; closing aborts the rest
    assert first.object == "text_completion"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=services.model, prompt=prompt, max_tokens=E2E_MAX_MODEL_LEN - 99)
    assert err.value.code == "context_length_exceeded"
    assert err.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_models_health_and_ready(services: RunningServices) -> None:
    models = httpx.get(f"{services.base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [services.model]
    assert httpx.get(f"{services.base_url}/health").status_code == 200
    assert httpx.get(f"{services.base_url}/ready").json()["ready"] is True
