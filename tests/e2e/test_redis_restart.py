"""Reliability scenario 2: Redis killed and restarted (same port, all data lost) with streams in flight.

This module runs its own Redis and its own tokenizer, engine and gateway, so the session's shared services
never see the outage. Expected: streams in flight end with an in-band error and [DONE] (or complete); new
requests during the outage get 503 with Retry-After at once; within 10 s of Redis returning every process
(none restarted) serves again, having logged a bounded number of warnings; nothing stays pending.
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

from pagedserve.shared.model_source import DEFAULT_MODEL
from pagedserve.shared.redis_server import PrivateRedis
from tests.conftest import running_stack
from tests.e2e.checks import answer_normally, wait_nothing_pending

NUM_STREAMS = 4
OUTAGE_S = 3.0
RECOVERY_LIMIT_S = 10.0
MAX_WARNINGS = 20  # warning/error lines, all services together, from the kill until service resumed (~8 seen)
_WARNING = re.compile(r" (WARNING|ERROR|CRITICAL) ")


@dataclass
class Stack:
    redis: PrivateRedis
    base_url: str
    processes: dict[str, subprocess.Popen[bytes]]
    log_dir: Path

    def num_warnings(self) -> int:
        return sum(len(_WARNING.findall((self.log_dir / f"{name}.log").read_text())) for name in self.processes)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    redis = PrivateRedis().start()
    log_dir = tmp_path_factory.mktemp("redis-restart-logs")
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": redis.url, "PAGEDSERVE_LOG_LEVEL": "INFO"}
    try:
        with running_stack(env, log_dir) as (base_url, processes):
            yield Stack(redis, base_url, processes, log_dir)
    finally:
        redis.stop()


async def stream_until_done(client: httpx.AsyncClient, prompt: str, first_token: asyncio.Event) -> list[Any]:
    body = {
        "model": DEFAULT_MODEL,
        "prompt": prompt,
        "max_tokens": 300,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    events: list[Any] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                first_token.set()
    return events


def refused_quickly(base_url: str) -> httpx.Response:
    started = time.monotonic()
    response = httpx.post(
        f"{base_url}/v1/completions", timeout=10, json={"model": DEFAULT_MODEL, "prompt": "Hello", "max_tokens": 4}
    )
    assert time.monotonic() - started < 3, "a request during the outage waited instead of failing fast"
    return response


def first_success_after(base_url: str, limit_s: float) -> float:
    """Seconds until a normal request succeeds (each try bounded), failing past `limit_s`."""
    started = time.monotonic()
    while True:
        try:
            response = httpx.post(
                f"{base_url}/v1/completions",
                timeout=5,
                json={"model": DEFAULT_MODEL, "prompt": "Hello", "max_tokens": 4},
            )
            if response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        assert time.monotonic() - started < limit_s, f"service did not resume within {limit_s}s of Redis returning"
        time.sleep(0.2)


def test_redis_restart_under_load(stack: Stack) -> None:
    port = stack.redis.port

    async def scenario() -> tuple[list[list[Any]], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
            started = [asyncio.Event() for _ in range(NUM_STREAMS)]
            tasks = [
                asyncio.create_task(stream_until_done(client, f"Tell a long story number {i}.", started[i]))
                for i in range(NUM_STREAMS)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=60)
            assert stack.redis.process is not None
            stack.redis.process.kill()  # a crash: no clean shutdown, everything in memory is lost
            stack.redis.process.wait()
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=15)
            refused = await asyncio.to_thread(refused_quickly, stack.base_url)
            deadline = time.monotonic() + 3  # readiness follows the registry's next refresh (1 s)
            while (ready := await client.get("/ready")).status_code == 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            return list(results), refused, ready

    warnings_before = stack.num_warnings()
    results, refused, ready = asyncio.run(scenario())
    for events in results:  # each stream ended: in-band error then [DONE], or complete
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert "error" in last or last["choices"][0]["finish_reason"] == "length", last
    assert any("error" in events[-2] for events in results), "no stream was cut: the outage was not mid-stream"
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["message"]
    assert ready.status_code == 503

    time.sleep(OUTAGE_S)
    stack.redis = PrivateRedis(port=port).start()  # the same address, empty
    recovery_s = first_success_after(stack.base_url, RECOVERY_LIMIT_S)
    print(f"service resumed {recovery_s:.1f}s after Redis returned")

    assert all(p.poll() is None for p in stack.processes.values()), "a service died instead of reconnecting"
    new_warnings = stack.num_warnings() - warnings_before
    print(f"{new_warnings} warning/error lines during the outage")
    assert new_warnings <= MAX_WARNINGS, f"{new_warnings} warning/error lines: a log flood"
    wait_nothing_pending(stack.redis.url, DEFAULT_MODEL)
    answer_normally(stack.base_url, DEFAULT_MODEL)
