"""/v1/completions through the real app, with `Frontend.submit` scripted (no Redis, tokenizer or engine
service): one prompt or a batch, echo, logprobs of the prompt, the client's request id, streaming, and a
refused prompt of a batch releasing the accepted ones."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request
from starlette.testclient import TestClient

from pagedserve.services.gateway import schemas
from pagedserve.services.gateway.app import build_app
from pagedserve.services.gateway.completions import serve
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.validation import validate
from pagedserve.shared.protocol import CompletionRequest
from pagedserve.shared.tokenizer_loader import load_tokenizer
from tests.gateway.gateway_helpers import (
    AbortRecorder,
    ScriptedSubmit,
    fake_logprob,
    offline_config,
    offline_frontend,
)

PROMPTS = ["The sky is", "Roses are red"]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def answer(prompt: str, index: int) -> str:
    return f" answer {index} to {prompt.split()[0]}"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.fixture()
def app(tokenizer: Any) -> Iterator[tuple[TestClient, Frontend, ScriptedSubmit, AbortRecorder]]:
    app = build_app(offline_config())
    frontend: Frontend = app.state.frontend
    _, recorder = offline_frontend(frontend)
    script = ScriptedSubmit(frontend, tokenizer, answer, refuse={"too long": APIError(400, "too long", param="prompt")})
    frontend.submit = script  # type: ignore[method-assign]
    # No `with`: the lifespan (the Redis readers) never starts; each request runs on its own event loop.
    yield TestClient(app), frontend, script, recorder


def post(client: TestClient, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": "m", "max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_one_prompt_with_echo_n_and_the_clients_request_id(app: Any, tokenizer: Any) -> None:
    client, frontend, script, _ = app
    body = post(client, prompt=PROMPTS[0], n=2, echo=True, request_id="mine")
    assert body["id"] == "cmpl-mine" and body["object"] == "text_completion" and body["model"] == "m"
    assert [c["text"] for c in body["choices"]] == [PROMPTS[0] + answer(PROMPTS[0], j) for j in range(2)]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert {c["finish_reason"] for c in body["choices"]} == {"length"}
    (wire,) = script.requests
    assert isinstance(wire, CompletionRequest) and wire.prompt == PROMPTS[0]
    assert wire.request_id.startswith("cmpl-") and wire.request_id != "cmpl-mine"  # ours stays unique inside
    prompt_tokens = len(tokenizer.encode(PROMPTS[0]))
    completion_tokens = sum(len(tokenizer.encode(answer(PROMPTS[0], j))) for j in range(2))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == completion_tokens
    assert frontend.num_in_flight == 0 and frontend.router.queues == {}


def test_a_batch_numbers_choices_by_prompt_then_sample_and_sums_usage(app: Any, tokenizer: Any) -> None:
    client, frontend, script, _ = app
    ids = tokenizer.encode(PROMPTS[1])
    body = post(client, prompt=[tokenizer.encode(PROMPTS[0]), ids], n=2, echo=True, return_token_ids=True)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice in choices:
        prompt = PROMPTS[choice["index"] // 2]  # prompt i, sample j -> index i * n + j
        expected = answer(prompt, choice["index"] % 2)
        assert choice["text"] == tokenizer.decode(tokenizer.encode(prompt)) + expected  # token ids echo decoded
        assert choice["prompt_token_ids"] == tokenizer.encode(prompt)
        assert choice["token_ids"] == tokenizer.encode(expected, add_special_tokens=False)
    wires = script.requests
    assert len(wires) == 2 and all(isinstance(w, CompletionRequest) for w in wires)
    batch_id = wires[0].request_id.rsplit("-", 1)[0]
    assert [w.request_id for w in wires] == [f"{batch_id}-0", f"{batch_id}-1"]  # one wire request per prompt
    assert body["id"] == batch_id
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert frontend.num_in_flight == 0


def test_echoed_and_vllm_prompt_logprobs_belong_to_each_choices_own_prompt(app: Any, tokenizer: Any) -> None:
    client, _, script, _ = app
    body = post(client, prompt=PROMPTS, echo=True, logprobs=1, prompt_logprobs=1)
    assert all(w.sampling.get("prompt_logprobs") == 1 for w in script.requests)
    for choice, prompt in zip(body["choices"], PROMPTS):
        prompt_ids = tokenizer.encode(prompt)
        answer_ids = tokenizer.encode(answer(prompt, 0), add_special_tokens=False)
        logprobs = choice["logprobs"]
        # echo + logprobs: the prompt's tokens first (the first one has none), then the generated ones
        assert len(logprobs["tokens"]) == len(prompt_ids) + len(answer_ids)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1 : len(prompt_ids)] == [fake_logprob(t) for t in prompt_ids[1:]]
        assert logprobs["token_logprobs"][len(prompt_ids) :] == [fake_logprob(t) for t in answer_ids]
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["text_offset"][len(prompt_ids)] == len(prompt)  # generated text starts after the echo
        vllm = choice["prompt_logprobs"]
        assert len(vllm) == len(prompt_ids) and vllm[0] is None
        second = prompt_ids[1]
        assert vllm[1] == {
            str(second): {"logprob": fake_logprob(second), "rank": 1, "decoded_token": tokenizer.decode([second])}
        }


def test_a_streamed_batch_sends_each_choice_its_echo_first(app: Any) -> None:
    client, frontend, _, _ = app
    body = {"model": "m", "prompt": PROMPTS, "echo": True, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]].append(choice["text"])
    for index, prompt in enumerate(PROMPTS):
        assert texts[index][0] == prompt  # the echo goes out first, on its own
        assert "".join(texts[index]) == prompt + answer(prompt, 0)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert frontend.num_in_flight == 0


def test_a_refused_prompt_fails_the_batch_and_releases_the_accepted_prompts(app: Any) -> None:
    client, frontend, script, recorder = app
    response = client.post("/v1/completions", json={"model": "m", "prompt": [PROMPTS[0], "too long", PROMPTS[1]]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"
    accepted = {gen.request_id for gen in script.generations}
    assert len(accepted) == 2  # the two others were accepted, then released: aborted in the engine
    assert recorder.aborted_ids == accepted
    assert frontend.num_in_flight == 0 and frontend.router.queues == {}


def test_an_echoed_token_id_prompt_keeps_its_special_tokens(app: Any, tokenizer: Any) -> None:
    client, _, _, _ = app
    ids = [tokenizer.bos_token_id, *tokenizer.encode("user")]
    body = post(client, prompt=ids, echo=True)
    text = body["choices"][0]["text"]
    assert text.startswith(f"{tokenizer.bos_token}user answer 0 to ")  # decoded as sent, not skipped


def test_serve_gives_every_prompt_the_callers_trace_and_names_the_batch_by_the_clients_id(app: Any) -> None:
    _, frontend, script, _ = app
    req = validate(schemas.CompletionRequest, {"model": "m", "prompt": PROMPTS, "request_id": "mine", "max_tokens": 4})
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b""}
    scope["headers"] = [(b"traceparent", TRACEPARENT.encode())]

    async def receive() -> dict[str, Any]:  # the client stays connected
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    response = asyncio.run(serve(Request(scope, receive), req, frontend, frontend.settings))
    body = json.loads(bytes(response.body))
    assert body["id"] == "cmpl-mine" and len(body["choices"]) == 2
    assert [w.traceparent for w in script.requests] == [TRACEPARENT, TRACEPARENT]
    assert [w.max_tokens for w in script.requests] == [4, 4]
