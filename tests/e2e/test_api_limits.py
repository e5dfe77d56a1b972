"""API keys, the body cap, the in-flight cap and the per-request timeout, on one extra gateway process
with tight settings in front of the session's Redis, tokenizer and engine."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.shared.redis_server import free_port
from tests.conftest import RunningServices, start_service, stop_all, wait_ready

KEYS = ["first-key", "second-key"]
MAX_BODY = 4096
TIMEOUT_S = 8
MSG = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def limited(services: RunningServices, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_dir: Path = tmp_path_factory.mktemp("limited-gateway")
    port = free_port()
    env = {
        **os.environ,
        "PAGEDSERVE_REDIS_URL": services.redis_url,
        "PAGEDSERVE_API_KEYS": ",".join(KEYS),
    }  # keys from the environment, comma-separated
    args = [
        "gateway",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-in-flight",
        "2",
        "--max-body-bytes",
        str(MAX_BODY),
        "--request-timeout-s",
        str(TIMEOUT_S),
    ]
    processes = {"gateway": start_service("limited-gateway", args, env, log_dir)}
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, processes, timeout_s=120)  # /ready needs no key
        yield base_url
    finally:
        stop_all(processes)


def client(base_url: str, key: str = KEYS[1]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)


def test_api_keys(limited: str, services: RunningServices) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        client(limited, "wrong-key").chat.completions.create(model=services.model, messages=MSG, max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    no_key = httpx.post(f"{limited}/v1/chat/completions", json={"model": services.model, "messages": MSG})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{limited}/v1/models").status_code == 401
    assert httpx.post(f"{limited}/tokenize", json={"model": services.model, "prompt": "x"}).status_code == 401
    assert httpx.get(f"{limited}/health").status_code == 200
    for key in KEYS:
        reply = client(limited, key).chat.completions.create(model=services.model, messages=MSG, max_tokens=2)
        assert reply.usage.completion_tokens == 2
    assert [m.id for m in client(limited).models.list()] == [services.model]
    assert client(limited).models.retrieve(services.model).id == services.model


def test_oversized_body_is_413(limited: str, services: RunningServices) -> None:
    big = [{"role": "user", "content": "x" * MAX_BODY}]
    with pytest.raises(openai.APIStatusError) as err:
        client(limited).chat.completions.create(model=services.model, messages=big, max_tokens=2)
    assert err.value.status_code == 413 and err.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_beyond_the_in_flight_cap_is_429_with_retry_after(limited: str, services: RunningServices) -> None:
    api = client(limited)
    streams = [
        api.chat.completions.create(
            model=services.model, messages=MSG, max_tokens=200, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in range(2)
    ]
    try:
        for stream in streams:
            next(iter(stream))  # both are in flight now
        with pytest.raises(openai.RateLimitError) as err:
            api.chat.completions.create(model=services.model, messages=MSG, max_tokens=2)
        assert err.value.status_code == 429 and int(err.value.response.headers["retry-after"]) >= 1
    finally:
        for stream in streams:
            stream.close()  # the gateway aborts them and frees their slots
    deadline = time.monotonic() + 30
    while True:
        try:
            reply = api.chat.completions.create(model=services.model, messages=MSG, max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "closed streams never gave their slots back"
            time.sleep(0.2)
    assert reply.usage.completion_tokens == 2


def test_per_request_timeout(limited: str, services: RunningServices) -> None:
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client(limited).chat.completions.create(
            model=services.model, messages=MSG, max_tokens=1800, extra_body={"ignore_eos": True}
        )
    assert err.value.status_code == 408 and err.value.code == "timeout"
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 30
