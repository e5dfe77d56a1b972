"""Bad input of every class in reliability.md gets the right 4xx in the OpenAI error shape (status,
type and param checked), before any SSE byte; the server keeps serving normally afterwards."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import E2E_MAX_MODEL_LEN, RunningServices

MSG = [{"role": "user", "content": "What is the capital of France?"}]
JSON = {"content-type": "application/json"}


def chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": MSG, "max_tokens": 4, **fields}


def completion(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "Hello", "max_tokens": 4, **fields}


def bad_bodies(model: str) -> list[tuple[str, Any, int, str, str | None]]:
    """(route, body, status, error type, param). Bodies that are bytes are sent as they are."""
    c, p = "/v1/chat/completions", "/v1/completions"
    bad = "invalid_request_error"
    return [
        # malformed JSON and non-object bodies
        (c, b'{"model": "x", ', 400, bad, None),
        (c, b"\xff\xfe\x00", 400, bad, None),
        (c, b'{"model": NaN}', 400, bad, None),
        (c, b"[1, 2, 3]", 400, bad, None),
        (p, b'"just a string"', 400, bad, None),
        # missing and wrongly typed fields (unknown ones are ignored: test_request_fields.py)
        (c, {"messages": MSG}, 400, bad, "model"),
        (c, {"model": model}, 400, bad, "messages"),
        (p, {"model": model}, 400, bad, "prompt"),
        (c, chat(model, tools=[{"type": "function"}]), 400, bad, "tools[0].function"),  # missing
        (p, completion(model, suffix="!"), 400, bad, "suffix"),
        (c, chat(model, temperature="hot"), 400, bad, "temperature"),
        (c, chat(model, n="2"), 400, bad, "n"),
        (c, chat(model, stream="yes"), 400, bad, "stream"),
        (c, chat(model, store="yes"), 400, bad, "store"),  # accepted and unused, but typed
        (c, chat(model, stop=[1, 2]), 400, bad, "stop[0]"),
        (c, chat(model, logprobs=1), 400, bad, "logprobs"),
        (p, completion(model, logprobs=True), 400, bad, "logprobs"),
        (p, completion(model, prompt={"text": "x"}), 400, bad, "prompt"),
        # out-of-range sampling values
        (c, chat(model, temperature=-0.1), 400, bad, "temperature"),
        (c, chat(model, temperature=2.01), 400, bad, "temperature"),
        (c, chat(model, top_p=0), 400, bad, "top_p"),
        (c, chat(model, top_p=1.5), 400, bad, "top_p"),
        (c, chat(model, top_k=-5), 400, bad, "top_k"),
        (c, chat(model, min_p=-0.5), 400, bad, "min_p"),
        (c, chat(model, presence_penalty=2.5), 400, bad, "presence_penalty"),
        (c, chat(model, frequency_penalty=-2.5), 400, bad, "frequency_penalty"),
        (c, chat(model, repetition_penalty=0), 400, bad, "repetition_penalty"),
        (c, chat(model, n=0), 400, bad, "n"),
        (c, chat(model, seed=2**64), 400, bad, "seed"),
        (c, chat(model, max_tokens=0), 400, bad, "max_tokens"),
        (c, chat(model, max_tokens=-1), 400, bad, "max_tokens"),
        (c, chat(model, max_completion_tokens=0), 400, bad, "max_completion_tokens"),
        (c, chat(model, min_tokens=-1), 400, bad, "min_tokens"),
        (c, chat(model, min_tokens=5, max_tokens=4), 400, bad, "min_tokens"),
        (c, chat(model, logprobs=True, top_logprobs=21), 400, bad, "top_logprobs"),
        (c, chat(model, top_logprobs=2), 400, bad, "top_logprobs"),
        (p, completion(model, logprobs=21), 400, bad, "logprobs"),
        (c, chat(model, logit_bias={"hello": 1}), 400, bad, "logit_bias"),
        (c, chat(model, logit_bias={"5": 100.5}), 400, bad, "logit_bias"),
        (c, chat(model, logit_bias={"999999": 1}), 400, bad, "logit_bias"),  # not a token of this model
        (c, chat(model, stop_token_ids=[999999]), 400, bad, "stop_token_ids"),
        (c, chat(model, stop=""), 400, bad, "stop"),
        (
            c,
            chat(model, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}),
            400,
            bad,
            "response_format",
        ),
        (c, chat(model, stream_options={"include_usage": True}), 400, bad, "stream_options"),
        (p, completion(model, suffix="x"), 400, bad, "suffix"),
        ("/v1/embeddings", {"model": model, "input": "hi"}, 400, bad, "model"),  # a chat model: no embeddings
        (p, completion(model, prompt=["a", [1]]), 400, bad, "prompt"),
        (c, chat(model, prompt_logprobs=1, stream=True), 400, bad, "prompt_logprobs"),
        (p, completion(model, best_of=3), 400, bad, "best_of"),
        # empty or malformed messages, unknown roles
        (c, chat(model, messages=[]), 400, bad, "messages"),
        (c, chat(model, messages="hi"), 400, bad, "messages"),
        (c, chat(model, messages=[{"role": "robot", "content": "x"}]), 400, bad, "messages[0].role"),
        (c, chat(model, messages=[MSG[0], {"content": "x"}]), 400, bad, "messages[1].role"),
        (c, chat(model, messages=[{"role": "user"}]), 400, bad, "messages[0]"),
        (c, chat(model, messages=[{"role": "user", "content": 5}]), 400, bad, "messages[0].content"),
        (
            c,
            chat(model, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            400,
            bad,
            "messages[0].content[0].type",
        ),
        (c, chat(model, chat_template_kwargs={"chat_template": "{{ 7 }}"}), 400, bad, "chat_template_kwargs"),
        (p, completion(model, prompt=[]), 400, bad, "prompt"),
        (p, completion(model, prompt=[1, 99999999]), 400, bad, "prompt"),
        # oversized n, stop lists and logit_bias maps (the gateway's caps: 16, 16, 1024)
        (c, chat(model, n=17), 400, bad, "n"),
        (c, chat(model, stop=[f"s{i}" for i in range(17)]), 400, bad, "stop"),
        (c, chat(model, logit_bias={str(i): 1 for i in range(1025)}), 400, bad, "logit_bias"),
        # unknown model (known only once an engine serves it)
        (c, chat("no-such-model"), 404, bad, "model"),
        (p, completion("no-such-model"), 404, bad, "model"),
    ]


def test_every_bad_input_class_gets_a_clear_4xx_then_service_is_normal(services: RunningServices) -> None:
    failures = []
    with httpx.Client(base_url=services.base_url, timeout=60) as http:
        for i, (route, body, status, type_, param) in enumerate(bad_bodies(services.model)):
            for stream in (False, True):  # streaming requests fail the same way, before any SSE byte
                if stream and (not isinstance(body, dict) or "stream_options" in body):
                    continue  # raw bytes; or valid once streaming
                payload = {**body, "stream": True} if stream and "stream" not in body else body
                if isinstance(payload, bytes):
                    response = http.post(route, content=payload, headers=JSON)
                else:
                    response = http.post(route, json=payload)
                got: tuple[Any, ...] = (response.status_code, response.headers.get("content-type"))
                if got[0] == status and got[1] == "application/json":
                    error = response.json()["error"]
                    got = (status, error["type"], error["param"], sorted(error))
                    if got == (status, type_, param, ["code", "message", "param", "type"]) and error["message"]:
                        continue
                failures.append((i, route, stream, str(body)[:80], got))
        assert not failures, "\n".join(map(str, failures))

        response = http.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
        assert response.status_code == 415 and response.json()["error"]["type"] == "invalid_request_error"

    # Afterwards a normal request is served as usual.
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model=services.model, messages=MSG, temperature=0, max_tokens=10)
    assert "Paris" in (reply.choices[0].message.content or "")
    for name, process in services.processes.items():
        assert process.poll() is None, f"{name} died"


def test_context_boundary_for_chat_exactly_at_the_limit_works_one_over_fails(services: RunningServices) -> None:
    """The limit counts the rendered chat template: /tokenize tells how long the prompt is."""
    tokens = httpx.post(f"{services.base_url}/tokenize", json={"model": services.model, "messages": MSG}).json()
    room = E2E_MAX_MODEL_LEN - tokens["count"]
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=300)
    with client.chat.completions.create(model=services.model, messages=MSG, max_tokens=room, stream=True) as stream:
        first = next(iter(stream))  # accepted: closing the stream aborts the rest
    assert first.choices[0].delta.role == "assistant"
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=services.model, messages=MSG, stream=True, **{field: room + 1})
        assert err.value.code == "context_length_exceeded"
        assert err.value.body["param"] == field  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:  # no max_tokens: the prompt alone must leave room
        client.completions.create(
            model=services.model, prompt=list(range(1000, 1000 + E2E_MAX_MODEL_LEN)), max_tokens=None
        )
    assert err.value.code == "context_length_exceeded"
    assert err.value.body["param"] == "prompt"  # type: ignore[index]
