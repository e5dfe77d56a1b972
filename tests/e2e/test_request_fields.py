"""OpenAI fields that do not apply are accepted; unknown fields are ignored, named in `X-Ignored-Fields`
(chat and completions, streaming or not) and logged once per name; a wrongly typed field is still a 400.
Strict mode (400 naming the field) is checked in tests/gateway/test_app.py."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RunningServices

MSG = [{"role": "user", "content": "What is the capital of France?"}]
NOT_APPLICABLE = {  # what real clients send; known to the schema, unused
    "store": False,
    "metadata": {"team": "a"},
    "service_tier": "auto",
    "parallel_tool_calls": True,
    "user": "u1",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "reasoning_effort": "low",
    "verbosity": "low",
    "modalities": ["text"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
}


def test_openai_client_extra_fields_are_accepted(services: RunningServices) -> None:
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model=services.model,
        messages=MSG,
        max_tokens=3,
        temperature=0,
        extra_body={**NOT_APPLICABLE, "frobnicate": 1, "x_client_trace": {"a": [1]}},
    )
    reply = raw.parse()
    assert reply.choices[0].message.content
    assert raw.headers["x-ignored-fields"] == "frobnicate, x_client_trace"  # the known ones are not listed
    plain = client.chat.completions.with_raw_response.create(
        model=services.model, messages=MSG, max_tokens=1, extra_body=NOT_APPLICABLE
    )
    assert "x-ignored-fields" not in plain.headers

    with pytest.raises(openai.BadRequestError) as err:  # a known field of the wrong type is still refused
        client.chat.completions.create(
            model=services.model, messages=MSG, max_tokens=1, extra_body={"store": "yes", "frobnicate": 1}
        )
    assert err.value.body["param"] == "store"  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True])
def test_the_header_names_ignored_fields_on_every_route(services: RunningServices, stream: bool) -> None:
    chat = {
        "model": services.model,
        "messages": [{**MSG[0], "cache_control": {"type": "x"}}],
        "max_tokens": 2,
        "stream": stream,
        "chat_thing": 1,
    }
    completion = {"model": services.model, "prompt": "Hello", "max_tokens": 2, "stream": stream, "store": True}
    with httpx.Client(base_url=services.base_url, timeout=300) as http:
        for route, body, expected in (
            ("/v1/chat/completions", chat, "messages[0].cache_control, chat_thing"),
            ("/v1/completions", completion, "store"),
        ):  # `store` is chat's only
            with http.stream("POST", route, json=body) as response:
                text = response.read().decode()
                assert response.status_code == 200, text
                assert response.headers["x-ignored-fields"] == expected, route
                assert ("data: [DONE]" in text) == stream
    log = (services.log_dir / "gateway.log").read_text()
    assert "ignored unknown request field(s)" in log and "chat_thing" in log


def _completion(services: RunningServices, **extra: object) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    raw = client.completions.with_raw_response.create(
        model=services.model, prompt="The capital of France is", max_tokens=4, temperature=0, extra_body=extra
    )
    assert "x-ignored-fields" not in raw.headers  # every vLLM field here is known, and has its effect
    return raw.parse()


def test_allowed_token_ids_yields_only_those_ids(services: RunningServices) -> None:
    tokens = httpx.post(
        f"{services.base_url}/tokenize", json={"model": services.model, "prompt": " yes no"}, timeout=60
    ).json()["tokens"]
    assert len(tokens) == 2
    reply = _completion(services, allowed_token_ids=tokens, logprobs=0)
    assert reply.choices[0].logprobs is not None
    assert set(reply.choices[0].logprobs.tokens or []) <= {" yes", " no"}
    assert reply.choices[0].text.replace(" yes", "").replace(" no", "") == ""


def test_bad_words_are_never_generated(services: RunningServices) -> None:
    assert "Paris" in _completion(services).choices[0].text  # the model's greedy answer, without the ban
    banned = _completion(services, bad_words=["Paris"]).choices[0].text
    assert "Paris" not in banned and banned


def test_cache_salt_keeps_tenants_apart_in_the_prefix_cache(services: RunningServices) -> None:
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    prompt = "Tenant isolation check: " + "lorem ipsum dolor sit amet " * 12

    def cached(salt: str) -> int:
        reply = client.completions.create(
            model=services.model, prompt=prompt, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same tenant hits its own blocks
    assert cached("tenant-b") == 0  # another tenant's identical prompt does not


def test_response_fields_vllm_clients_read(services: RunningServices) -> None:
    body = {
        "model": services.model,
        "prompt": "The capital of France is",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 0,
    }
    plain = httpx.post(f"{services.base_url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert plain["prompt_logprobs"] is None and plain["stop_reason"] is None  # present, null
    tokens, tops = plain["logprobs"]["tokens"], plain["logprobs"]["top_logprobs"]
    assert [list(top) for top in tops] == [[token] for token in tokens]  # logprobs=0: the sampled token only
    stop = plain["text"].strip().split()[0]
    stopped = httpx.post(f"{services.base_url}/v1/completions", json={**body, "stop": [stop]}, timeout=120).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["stop_reason"] == stop
    ids = httpx.post(f"{services.base_url}/v1/completions", json={**body, "return_token_ids": True}, timeout=120)
    second = ids.json()["choices"][0]["token_ids"][1]
    by_id = httpx.post(f"{services.base_url}/v1/completions", json={**body, "stop_token_ids": [second]}, timeout=120)
    assert by_id.json()["choices"][0]["finish_reason"] == "stop"
    assert by_id.json()["choices"][0]["stop_reason"] == second  # the stop token's id, as vLLM answers
    chat = httpx.post(
        f"{services.base_url}/v1/chat/completions",
        timeout=120,
        json={"model": services.model, "messages": MSG, "max_tokens": 2, "temperature": 0},
    ).json()
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None
    assert chat["choices"][0]["stop_reason"] is None


def test_request_id_names_the_response(services: RunningServices) -> None:
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    chat = client.chat.completions.create(
        model=services.model, messages=MSG, max_tokens=2, extra_body={"request_id": "trace-42"}
    )
    assert chat.id == "chatcmpl-trace-42"
    again = client.chat.completions.create(
        model=services.model, messages=MSG, max_tokens=2, extra_body={"request_id": "trace-42"}
    )  # reused: still served
    assert again.id == "chatcmpl-trace-42" and again.choices[0].message.content is not None
    text = _completion(services, request_id="batch-7")
    assert text.id == "cmpl-batch-7"
    chunks = list(
        client.completions.create(
            model=services.model, prompt="Hi", max_tokens=2, stream=True, extra_body={"request_id": "s-1"}
        )
    )
    assert chunks and all(chunk.id == "cmpl-s-1" for chunk in chunks)


def test_detokenization_fields(services: RunningServices) -> None:
    base = _completion(services)
    stop = base.choices[0].text.strip().split()[0]
    kept = _completion(services, stop=[stop], include_stop_str_in_output=True).choices[0]
    cut = _completion(services, stop=[stop]).choices[0]
    assert kept.text == cut.text + stop and kept.finish_reason == "stop"  # the text ends with the stop string
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    eos = client.completions.create(
        model=services.model,
        prompt=[2, 2],
        max_tokens=3,
        temperature=0,
        extra_body={"allowed_token_ids": [1], "skip_special_tokens": False},
    )
    assert eos.choices[0].text == "<|im_start|>" * 3  # token 1 is SmolLM2's <|im_start|>: kept as text
    hidden = client.completions.create(
        model=services.model, prompt=[2, 2], max_tokens=3, temperature=0, extra_body={"allowed_token_ids": [1]}
    )
    assert hidden.choices[0].text == ""  # skipped by default


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids(services: RunningServices, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    tokenized = httpx.post(
        f"{services.base_url}/tokenize", json={"model": services.model, "prompt": "Hi there"}, timeout=60
    ).json()["tokens"]
    kwargs = {
        "model": services.model,
        "prompt": "Hi there",
        "max_tokens": 5,
        "temperature": 0,
        "extra_body": {"return_token_ids": True, "ignore_eos": True},
    }
    if stream:
        prompt_ids, output_ids = None, []  # type: ignore[var-annotated]
        for chunk in client.completions.create(**kwargs, stream=True):
            extra = chunk.choices[0].model_extra or {}
            prompt_ids = extra.get("prompt_token_ids") or prompt_ids
            output_ids += extra.get("token_ids") or []
    else:
        extra = client.completions.create(**kwargs).choices[0].model_extra or {}
        prompt_ids, output_ids = extra["prompt_token_ids"], extra["token_ids"]
    assert prompt_ids == tokenized and len(output_ids) == 5
    detok = httpx.post(
        f"{services.base_url}/detokenize", json={"model": services.model, "tokens": output_ids}, timeout=60
    ).json()["prompt"]
    whole = client.completions.create(
        model=services.model, prompt="Hi there", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert detok == whole.choices[0].text


def test_min_characters_holds_off_the_end_until_the_text_is_that_long(services: RunningServices) -> None:
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    ask: dict[str, Any] = dict(model=services.model, messages=[{"role": "user", "content": "Say hi."}], temperature=0)
    plain = client.chat.completions.create(**ask, max_tokens=64).choices[0]
    assert plain.finish_reason == "stop"
    short = len(plain.message.content or "")
    longer = client.chat.completions.create(**ask, max_tokens=64, extra_body={"min_characters": short + 20})
    text = longer.choices[0].message.content or ""
    assert len(text) >= short + 20 or longer.choices[0].finish_reason == "length"
    assert text.startswith(plain.message.content or "")  # greedy: the same text, then more where it had ended
    assert len(text) > short
