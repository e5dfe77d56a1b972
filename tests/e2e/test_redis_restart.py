"""Reliability scenario 2: Redis stopped and restarted (same port, no persistence: all data lost) under 16
concurrent greedy streams over two engine replicas of a tiny random-weight model.

This module runs its own Redis and its own services, so the session's shared services never see the
outage. Expected: an outage shorter than --redis-outage-grace-s loses no stream: engines keep generating
and hold their tokens, gateways keep the streams open, and every stream completes equal to its
non-streamed reference, with no gap and no repeat; a request not yet accepted gets 503 with Retry-After
at once; the first new request succeeds within 2 s of Redis returning; no process restarts, the logs
carry a bounded number of warnings, and nothing stays pending.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.shared.redis_server import PrivateRedis, free_port
from tests.conftest import start_service, stop_all, wait_ready
from tests.e2e.checks import answer_normally, wait_nothing_pending
from tests.e2e.tiny_llama import build_tiny_llama

MODEL = "tiny-redis-restart"
NUM_STREAMS = 16
MAX_TOKENS = 160
OUTAGE_S = 1.5
RESUME_LIMIT_S = 2.0  # the bound: the first new request succeeds within 2 s of Redis returning
MAX_WARNINGS = 30  # warning/error lines, all services together, from the stop until service resumed
_WARNING = re.compile(r" (WARNING|ERROR|CRITICAL) ")


@dataclass
class Stack:
    redis: PrivateRedis
    base_url: str
    processes: dict[str, subprocess.Popen[bytes]]
    log_dir: Path
    tokenizer_metrics_port: int

    def num_warnings(self) -> int:
        return sum(len(_WARNING.findall((self.log_dir / f"{name}.log").read_text())) for name in self.processes)


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("models") / MODEL, smollm2_dir)
    redis = PrivateRedis().start()
    log_dir = tmp_path_factory.mktemp("redis-restart-logs")
    tokenizer_metrics_port = free_port()
    env = {
        **os.environ,
        "PAGEDSERVE_REDIS_URL": redis.url,
        "PAGEDSERVE_LOG_LEVEL": "INFO",
        "PAGEDSERVE_TOKENIZER_METRICS_PORT": str(tokenizer_metrics_port),
    }
    common = ["--model", str(model_dir), "--served-model-name", MODEL]
    engine = ["engine", *common, "--device", "cpu", "--cpu-threads", "1"]
    port = free_port()
    gateway = ["gateway", "--host", "127.0.0.1", "--port", str(port)]
    processes = {
        "rr-tokenizer": start_service("rr-tokenizer", ["tokenizer", *common], env, log_dir),
        "rr-engine-a": start_service("rr-engine-a", [*engine, "--engine-id", "rr-a"], env, log_dir),
        "rr-engine-b": start_service("rr-engine-b", [*engine, "--engine-id", "rr-b"], env, log_dir),
        "rr-gateway": start_service("rr-gateway", gateway, env, log_dir),
    }
    try:
        wait_ready(f"http://127.0.0.1:{port}", processes)
        yield Stack(redis, f"http://127.0.0.1:{port}", processes, log_dir, tokenizer_metrics_port)
    finally:
        stop_all(processes)
        redis.stop()
        for name in processes:
            print(f"----- {name} log (tail) -----\n" + (log_dir / f"{name}.log").read_text()[-2000:])


def _body(i: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": f"Story {i}: once upon a time",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def _stream(client: httpx.AsyncClient, i: int, first_token: asyncio.Event) -> tuple[str, str | None, list[str]]:
    text, finish, errors = "", None, []
    async with client.stream("POST", "/v1/completions", json=_body(i, stream=True)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                errors.append(chunk["error"]["message"])
                continue
            text += chunk["choices"][0]["text"]
            finish = chunk["choices"][0]["finish_reason"] or finish
            first_token.set()
    return text, finish, errors


def _first_success_after(base_url: str, limit_s: float) -> float:
    started = time.monotonic()
    while True:
        try:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
            response = httpx.post(f"{base_url}/v1/completions", timeout=5, json=body)
            if response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        assert time.monotonic() - started < 30, "the service did not resume at all"
        time.sleep(0.05)


def test_a_redis_restart_loses_no_stream_in_flight(stack: Stack) -> None:
    references = [
        httpx.post(f"{stack.base_url}/v1/completions", json=_body(i, stream=False), timeout=120).json()["choices"][0]
        for i in range(NUM_STREAMS)
    ]
    port = stack.redis.port
    warnings_before = stack.num_warnings()

    async def scenario() -> tuple[list[tuple[str, str | None, list[str]]], httpx.Response, float]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
            started = [asyncio.Event() for _ in range(NUM_STREAMS)]
            tasks = [asyncio.create_task(_stream(client, i, started[i])) for i in range(NUM_STREAMS)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
            stack.redis.stop()  # SIGTERM, no persistence: every stream, group and record is gone
            refused = await client.post("/v1/completions", json=_body(99, stream=False))
            await asyncio.sleep(OUTAGE_S)
            stack.redis = PrivateRedis(port=port).start()  # the same address, empty
            resumed_s = await asyncio.to_thread(_first_success_after, stack.base_url, RESUME_LIMIT_S)
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            return list(results), refused, resumed_s

    results, refused, resumed_s = asyncio.run(scenario())
    print(f"first new request served {resumed_s:.2f} s after Redis returned")
    for i, (text, finish, errors) in enumerate(results):
        assert errors == [], f"stream {i}: {errors}"
        assert (text, finish) == (references[i]["text"], "length"), f"stream {i} differs from its reference"
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert resumed_s < RESUME_LIMIT_S
    assert all(p.poll() is None for p in stack.processes.values()), "a service died instead of reconnecting"
    new_warnings = stack.num_warnings() - warnings_before
    print(f"{new_warnings} warning/error lines during the outage")
    assert new_warnings <= MAX_WARNINGS, f"{new_warnings} warning/error lines: a log flood"
    wait_nothing_pending(stack.redis.url, MODEL)
    answer_normally(stack.base_url, MODEL)


def _cached_tokens(base_url: str, prompt: list[int]) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    usage = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["usage"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def _routed_by_prefix(stack: Stack) -> float:
    """The tokenizer's pagedserve_router_decisions_total with reason "prefix", over the replicas."""
    text = httpx.get(f"http://127.0.0.1:{stack.tokenizer_metrics_port}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pagedserve_router_decisions_total" and sample.labels.get("reason") == "prefix"
    )


def test_after_a_redis_restart_the_router_rebuilds_its_index_and_routes_by_prefix_again(stack: Stack) -> None:
    """Issue 22: Redis restarts empty, so the KV-event stream and the router's view go with it; the engines keep
    their caches and publish snapshots once Redis is back, and the router sends each prompt to its holder again.
    Six prefixes computed before the outage, wherever pulled; after it, each one's continuation finds its whole
    prefix cached, and the router says it chose each replica by prefix."""
    prefixes = [[3000 + 200 * p + i for i in range(96)] for p in range(6)]  # six 16-token blocks each
    assert [_cached_tokens(stack.base_url, [*prefix, 7]) for prefix in prefixes] == [0] * 6
    port = stack.redis.port
    stack.redis.stop()
    time.sleep(0.5)
    stack.redis = PrivateRedis(port=port).start()
    _first_success_after(stack.base_url, RESUME_LIMIT_S)
    time.sleep(2.0)  # the engines' snapshots (due at once after an outage) and a heartbeat reach the tokenizer
    routed_before = _routed_by_prefix(stack)
    assert [_cached_tokens(stack.base_url, [*prefix, 50, 7]) for prefix in prefixes] == [96] * 6
    assert _routed_by_prefix(stack) - routed_before == 6
