"""Service-side faults on a random-weight tiny model (fast on a CPU), with a real Redis and real processes:

- no tokenizer running: a request gets 503 at once, naming the missing tokenizer (not 30 s of waiting);
- a request the gateway gave up on (its tokenizer hung past the accept timeout) never runs, even after
  the tokenizer comes back: the abort is recorded, and the tokenizer drops the request;
- an engine serving a smaller context than the model's (--max-model-len 256 here) sets the limit the
  tokenizer checks: an over-long streamed prompt gets a 400 context_length_exceeded before any header.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from pagedserve.shared import streams
from pagedserve.shared.protocol import ChatRequest, GenerateRequest, decode
from pagedserve.shared.redis_server import PrivateRedis, free_port
from tests.conftest import start_service, stop_all
from tests.e2e.tiny_llama import build_tiny_llama

MODEL = "tiny-svc-faults"
ENGINE_LIMIT = 256
ACCEPT_TIMEOUT_S = 2.0


@dataclass
class Stack:
    base_url: str
    redis: redis.Redis
    env: dict[str, str]
    common: list[str]
    log_dir: Path
    processes: dict[str, subprocess.Popen[bytes]]

    def start_tokenizer(self) -> subprocess.Popen[bytes]:
        tokenizer = start_service("svc-tokenizer", ["tokenizer", *self.common], self.env, self.log_dir)
        self.processes["svc-tokenizer"] = tokenizer
        wait_for(lambda: self.ready(), 120, "the gateway never became ready with a tokenizer")
        return tokenizer

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


def wait_for(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(redis_server: PrivateRedis, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """An engine serving a 256-token context and a gateway; the tests start the tokenizer when they need it."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("models") / MODEL, smollm2_dir)
    log_dir = tmp_path_factory.mktemp("svc-faults-logs")
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": redis_server.url, "PAGEDSERVE_LOG_LEVEL": "INFO"}
    common = ["--model", str(model_dir), "--served-model-name", MODEL]
    port = free_port()
    processes = {
        "svc-engine": start_service(
            "svc-engine",
            ["engine", *common, "--device", "cpu", "--cpu-threads", "1", "--max-model-len", str(ENGINE_LIMIT)],
            env,
            log_dir,
        ),
        "svc-gateway": start_service(
            "svc-gateway",
            ["gateway", "--host", "127.0.0.1", "--port", str(port), "--accept-timeout-s", str(ACCEPT_TIMEOUT_S)],
            env,
            log_dir,
        ),
    }
    client = redis.Redis.from_url(redis_server.url)
    stack = Stack(f"http://127.0.0.1:{port}", client, env, common, log_dir, processes)
    try:
        # /v1/models lists a model once it has a tokenizer too: the engine's heartbeat says it is up
        wait_for(lambda: bool(client.keys(streams.engine_key(MODEL, "*"))), 120, "no engine")
        yield stack
    finally:
        stop_all(processes)
        client.close()


def _messages(stack: Stack, stream: str) -> list[Any]:
    entries: Any = stack.redis.xrange(stream)
    return [decode(fields[streams.DATA_FIELD]) for _, fields in entries]


def _chat(stack: Stack) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
    )


def test_no_tokenizer_is_a_503_at_once(stack: Stack) -> None:
    started = time.monotonic()
    reply = _chat(stack)
    elapsed = time.monotonic() - started
    assert reply.status_code == 503 and elapsed < 10, (reply.status_code, elapsed)
    print(f"no tokenizer: 503 after {elapsed * 1000:.0f} ms")
    error = reply.json()["error"]
    assert error["code"] == "tokenizer_unavailable" and "tokenizer" in error["message"]
    assert reply.headers["retry-after"]


def test_a_request_given_up_never_runs(stack: Stack) -> None:
    tokenizer = stack.start_tokenizer()
    assert _chat(stack).status_code == 200
    tokenizer.send_signal(signal.SIGSTOP)  # hung: its heartbeat outlives the accept timeout
    try:
        started = time.monotonic()
        reply = _chat(stack)
        print(f"hung tokenizer: 503 after {time.monotonic() - started:.2f} s (accept timeout {ACCEPT_TIMEOUT_S} s)")
        assert reply.status_code == 503, reply.text  # no tokenizer answered within the accept timeout
        body = reply.text
        assert "127.0.0.1" not in body and "Error" not in body  # no internal detail
        given_up = _messages(stack, streams.request_stream(MODEL))[-1]
        assert isinstance(given_up, ChatRequest)
    finally:
        tokenizer.send_signal(signal.SIGCONT)
    assert stack.redis.exists(streams.aborted_key(MODEL, given_up.request_id))
    wait_for(
        lambda: not stack.redis.xpending(streams.request_stream(MODEL), streams.TOKENIZER_GROUP)["pending"],
        30,
        "the tokenizer did not get to the request",
    )
    forwarded = _messages(stack, streams.generate_stream(MODEL))
    assert given_up.request_id not in {m.request_id for m in forwarded if isinstance(m, GenerateRequest)}
    assert _chat(stack).status_code == 200  # and the next request is served


def test_the_engines_context_limit_is_checked_before_headers(stack: Stack) -> None:
    if not stack.ready():
        stack.start_tokenizer()
    models = httpx.get(f"{stack.base_url}/v1/models", timeout=5).json()["data"]
    assert [m["max_model_len"] for m in models if m["id"] == MODEL] == [ENGINE_LIMIT]
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=60)
    long_prompt = "one two three four five six seven eight nine ten " * 40  # ~400 tokens
    with pytest.raises(openai.BadRequestError) as err:  # a status before any SSE byte, not an in-band error
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, stream=True)
    assert err.value.code == "context_length_exceeded" and str(ENGINE_LIMIT) in str(err.value)
    ok = client.completions.create(model=MODEL, prompt="one two three", max_tokens=4)
    assert ok.usage is not None and ok.usage.prompt_tokens < ENGINE_LIMIT
