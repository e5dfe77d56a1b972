"""Failure scenarios from reliability.md that the shared services can take without being restarted."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import openai
import redis

from pagedserve.shared import streams
from pagedserve.shared.protocol import EngineHeartbeat, decode_as
from tests.conftest import RunningServices


def _engine_load(services: RunningServices) -> EngineHeartbeat:
    r = redis.Redis.from_url(services.redis_url)
    try:
        keys = list(r.scan_iter(match=streams.engine_key(services.model, "*")))
        assert len(keys) == 1, "the shared services run exactly one engine for the default model"
        raw = r.get(keys[0])
        assert raw is not None
        return decode_as(raw, EngineHeartbeat)
    finally:
        r.close()


def _wait_idle(services: RunningServices, idle_free: int, timeout_s: float) -> EngineHeartbeat:
    deadline = time.monotonic() + timeout_s
    while True:
        beat = _engine_load(services)
        if beat.num_running == 0 and beat.num_waiting == 0 and beat.num_free_blocks == idle_free:
            return beat
        assert time.monotonic() < deadline, f"engine not idle: {beat}"
        time.sleep(0.2)


def test_client_disconnect_mid_stream_frees_the_sequence(services: RunningServices) -> None:
    idle = _wait_idle(services, _engine_load(services).num_total_blocks, 30)
    body = {
        "model": services.model,
        "prompt": "Once upon a time",
        "max_tokens": 1500,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{services.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        deadline = time.monotonic() + 30
        while True:  # read on until a heartbeat (once a second) shows the sequence holding blocks
            assert next(lines) is not None
            busy = _engine_load(services)
            if busy.num_running == 1 and busy.num_free_blocks < idle.num_free_blocks:
                break
            assert time.monotonic() < deadline, f"the request never showed in the engine's load: {busy}"
    # The connection is closed here: the engine must drop the sequence and free its blocks.
    started = time.monotonic()
    _wait_idle(services, idle.num_free_blocks, timeout_s=10)
    assert time.monotonic() - started < 10


def test_cancellation_storm_then_a_normal_request(services: RunningServices) -> None:
    idle = _wait_idle(services, _engine_load(services).num_total_blocks, 30)
    client = openai.OpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    before = time.monotonic()
    client.chat.completions.create(model=services.model, messages=question, temperature=0, max_tokens=12)
    usual = time.monotonic() - before

    async def abandon(client: openai.AsyncOpenAI, i: int) -> None:
        with contextlib.suppress(TimeoutError, openai.APIError):
            await asyncio.wait_for(
                client.chat.completions.create(
                    model=services.model,
                    messages=[{"role": "user", "content": f"Tell me a long story number {i}."}],
                    max_tokens=400,
                    stream=(i % 2 == 0),
                ),
                timeout=0.3,
            )

    async def storm() -> None:
        async with openai.AsyncOpenAI(base_url=f"{services.base_url}/v1", api_key="x", max_retries=0) as aclient:
            await asyncio.gather(*(abandon(aclient, i) for i in range(200)))

    asyncio.run(storm())
    _wait_idle(services, idle.num_free_blocks, timeout_s=60)
    before = time.monotonic()
    reply = client.chat.completions.create(model=services.model, messages=question, temperature=0, max_tokens=12)
    assert "Paris" in (reply.choices[0].message.content or "")
    assert time.monotonic() - before < max(3 * usual, usual + 5)
