"""Constrained decoding through the whole pipeline with the `openai` client on the default model:
50 random JSON schemas sampled at temperature 1 all validate (and unconstrained they do not),
json_object always parses, vLLM's extras work on both endpoints, and bad constraints are 400s
naming the field before any SSE byte."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import RunningServices

NUM_SCHEMAS = 50


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A small object schema: every property required, bounded so that outputs stay short."""
    properties: dict[str, Any] = {}
    for i in range(rng.randint(1, 3)):
        properties[f"{rng.choice(['id', 'kind', 'size', 'tag', 'ok', 'items', 'meta'])}_{i}"] = random_value(rng, depth)
    required = sorted(rng.sample(sorted(properties), rng.randint(1, len(properties))))
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def random_value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "enum", "boolean", "string", "array"] + (["object"] if depth < 1 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10.5, "maximum": rng.choice([1.0, 99.5, 1000.0])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "north", "south", "yes", "no"], rng.randint(2, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "array":
        items = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b", "c"]}])
        return {"type": "array", "items": items, "minItems": 1, "maxItems": 3}
    return random_schema(rng, depth + 1)


SCHEMAS = [random_schema(random.Random(seed)) for seed in range(NUM_SCHEMAS)]
PROMPT = "Write a short record about a city."


@pytest.fixture(scope="module")
def client(services: RunningServices) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def aclient(services: RunningServices) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{services.base_url}/v1", api_key="unused", max_retries=0, timeout=900)


def schema_format(i: int, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": f"record_{i}", "schema": schema, "strict": True}}


def is_valid(text: str | None, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text or ""), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_random_json_schemas_validate_and_unconstrained_fail(
    aclient: openai.AsyncOpenAI, services: RunningServices
) -> None:
    messages = [{"role": "user", "content": PROMPT}]

    async def ask(i: int, constrained: bool) -> Any:
        extra: dict[str, Any] = {"response_format": schema_format(i, SCHEMAS[i])} if constrained else {}
        return await aclient.chat.completions.create(
            model=services.model,
            messages=messages,
            temperature=1.0,
            max_tokens=160 if constrained else 48,
            seed=i,
            **extra,
        )

    async def run_all() -> tuple[list[Any], list[Any]]:  # sent together: the engine batches them
        constrained = asyncio.gather(*(ask(i, True) for i in range(NUM_SCHEMAS)))
        plain = asyncio.gather(*(ask(i, False) for i in range(10)))
        return await constrained, await plain

    constrained, plain = asyncio.run(run_all())
    for i, reply in enumerate(constrained):
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    assert sum(not is_valid(r.choices[0].message.content, SCHEMAS[i]) for i, r in enumerate(plain)) >= 1


def test_json_object_always_parses(client: openai.OpenAI, services: RunningServices) -> None:
    reply = client.chat.completions.create(
        model=services.model,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        temperature=1.0,
        n=2,
        seed=7,
        max_tokens=120,
        response_format={"type": "json_object"},
    )
    for choice in reply.choices:
        if choice.finish_reason == "stop":
            json.loads(choice.message.content or "")
        else:  # cut by max_tokens: a prefix of JSON, never prose
            assert (choice.message.content or "").lstrip()[:1] in ("{", "[", '"') or choice.message.content == ""
    assert any(c.finish_reason == "stop" for c in reply.choices)


def test_vllm_extras_on_chat_and_completions(client: openai.OpenAI, services: RunningServices) -> None:
    choice = client.completions.create(
        model=services.model,
        prompt="Is water wet? Answer:",
        max_tokens=8,
        temperature=1.0,
        n=4,
        seed=1,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert {c.text for c in choice.choices} <= {"yes", "no"} and all(c.finish_reason == "stop" for c in choice.choices)
    regex = client.chat.completions.create(
        model=services.model,
        messages=[{"role": "user", "content": "A date?"}],
        max_tokens=16,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}},
    )
    text = regex.choices[0].message.content or ""
    assert len(text) == 10 and text.startswith("20") and text[4] == "-" and text[7] == "-", text
    streamed = client.completions.create(
        model=services.model,
        prompt="Numbers:",
        max_tokens=24,
        temperature=1.0,
        stream=True,
        seed=3,
        extra_body={
            "guided_json": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 2,
                "maxItems": 4,
            }
        },
    )
    chunks = list(streamed)
    values = json.loads("".join(c.choices[0].text for c in chunks if c.choices))
    assert 2 <= len(values) <= 4 and all(0 <= v <= 99 for v in values)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "a"}},
                }
            },
            "response_format",
        ),
        ({"guided_regex": "([a-z"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),  # two constraints
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ],
)
def test_invalid_constraint_is_a_400_before_any_sse_byte(
    services: RunningServices, extra: dict[str, Any], param: str
) -> None:
    body = {"model": services.model, "messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
    with httpx.stream("POST", f"{services.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        raw = response.read()
    assert response.status_code == 400, raw
    assert response.headers["content-type"].startswith("application/json")
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
