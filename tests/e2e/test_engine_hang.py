"""Takeover at heartbeat speed (issue 29): one of two engines hangs (SIGSTOP) mid-stream on a random-weight
tiny model. Its streams move to the other replica, and the requests sent right after it hung (which
Redis still handed to the hung engine, blocked in its read) are claimed as soon as its heartbeat key
expires, not after the claim-idle time. Every stream ends with exactly the greedy reference text, and
the slowest request sent after the hang ends within 8 s of the same load's slowest without a fault."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from pagedserve.shared import streams
from pagedserve.shared.redis_server import PrivateRedis, free_port
from tests.conftest import start_service, stop_all
from tests.e2e.checks import wait_nothing_pending
from tests.e2e.test_gateway_faults import Stack, heartbeat
from tests.e2e.tiny_llama import build_tiny_llama

MODEL = "tiny-faults"  # the name test_gateway_faults.heartbeat and Stack.start_engine use
LOAD = 16
MAX_TOKENS = 160
TTL = ["--heartbeat-ttl-s", "2", "--heartbeat-interval-s", "0.5"]  # the claim-idle time stays at 15 s


@pytest.fixture(scope="module")
def stack(redis_server: PrivateRedis, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("models") / MODEL, smollm2_dir)
    log_dir = tmp_path_factory.mktemp("hang-logs")
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": redis_server.url, "PAGEDSERVE_LOG_LEVEL": "INFO"}
    common = ["--model", str(model_dir), "--served-model-name", MODEL]
    port = free_port()
    processes = {
        "hang-tokenizer": start_service("hang-tokenizer", ["tokenizer", *common], env, log_dir),
        "hang-gateway": start_service(
            "hang-gateway", ["gateway", "--host", "127.0.0.1", "--port", str(port)], env, log_dir
        ),
    }
    try:
        yield Stack(f"http://127.0.0.1:{port}", redis_server.url, env, common, log_dir, processes)
    finally:
        stop_all(processes)


async def timed_stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, int, float]:
    """(text, completion tokens, seconds from send to the last chunk) of one greedy stream."""
    started, text, tokens = time.monotonic(), "", 0
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        text += "".join(c.text for c in chunk.choices)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens, time.monotonic() - started


def test_requests_on_a_hung_engine_move_at_heartbeat_speed(stack: Stack) -> None:
    steady = stack.start_engine("hang-steady", *TTL)
    hung = stack.start_engine("hang-doomed", *TTL)
    stack.wait_serving()
    before = [f"Story {i}:" for i in range(LOAD)]
    after = [f"Tale {i}:" for i in range(LOAD)]

    def client() -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0, timeout=120)

    async def reference() -> tuple[list[str], float]:
        async with client() as c:
            texts = []
            for prompts in (before, after):  # non-streamed, no fault: the greedy answers
                replies = await asyncio.gather(
                    *(
                        c.completions.create(
                            model=MODEL,
                            prompt=p,
                            max_tokens=MAX_TOKENS,
                            temperature=0,
                            extra_body={"ignore_eos": True},
                        )
                        for p in prompts
                    )
                )
                texts += [r.choices[0].text for r in replies]
            baseline = await asyncio.gather(*(timed_stream(c, p) for p in after))  # the same load, no fault
            return texts, max(seconds for *_, seconds in baseline)

    handed_to_hung: list[bytes] = []

    async def hand_to_hung(r: aioredis.Redis) -> list[bytes]:
        """What Redis does for a consumer hung in a blocking read: it hands it entries (one per blocked read).
        The engine's own read blocks only 200 ms, so reading as it makes sure the hang gets its share."""
        stream, ids = streams.generate_stream(MODEL), list[bytes]()
        deadline = time.monotonic() + 8
        while len(ids) < LOAD // 4 and time.monotonic() < deadline:
            reply: Any = await r.xreadgroup(
                streams.engine_group(MODEL), "hang-doomed", {stream: ">"}, count=1, block=100
            )
            ids += [entry_id for _, items in reply or [] for entry_id, _ in items]
        await r.aclose()
        return ids

    async def hang_mid_stream() -> tuple[list[tuple[str, int, float]], list[tuple[str, int, float]]]:
        async with client() as c:
            first = [asyncio.create_task(timed_stream(c, p)) for p in before]
            while (beat := heartbeat(stack, "hang-doomed")) is None or beat.num_running == 0:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)  # mid-way through its streams
            r = aioredis.Redis.from_url(stack.redis_url)
            await r.ping()  # connected before the hang
            hung.send_signal(signal.SIGSTOP)
            handed = asyncio.create_task(hand_to_hung(r))
            second = await asyncio.gather(*(timed_stream(c, p) for p in after))  # sent right after it hung
            handed_to_hung.extend(await handed)
            return list(await asyncio.gather(*first)), list(second)

    try:
        expected, no_fault_slowest = asyncio.run(reference())
        first, second = asyncio.run(hang_mid_stream())
        assert hung.poll() is None, "the hung engine died instead of hanging"
        answers = first + second
        assert [tokens for _, tokens, _ in answers] == [MAX_TOKENS] * (2 * LOAD)
        assert [text for text, _, _ in answers] == expected  # exact, moved or claimed or not
        slowest = max(seconds for *_, seconds in second)
        print(
            f"slowest of {LOAD} streams: {no_fault_slowest:.1f} s without a fault, {slowest:.1f} s sent "
            f"right after an engine hung ({len(handed_to_hung)} of them handed to the hung engine)"
        )
        assert handed_to_hung, "no request was handed to the hung engine: the scenario did not happen"
        assert slowest <= no_fault_slowest + 8, (slowest, no_fault_slowest)
        log = (stack.log_dir / "hang-steady.log").read_text()
        assert "consumer hang-doomed has no heartbeat: claimed" in log  # taken at heartbeat speed
        hung.send_signal(signal.SIGKILL)
        hung.send_signal(signal.SIGCONT)
        assert hung.wait(timeout=10) == -signal.SIGKILL
        wait_nothing_pending(stack.redis_url, MODEL)  # whatever it still held is claimed and finished
    finally:
        hung.send_signal(signal.SIGCONT)
        stop_all({"hang-steady": steady, "hang-doomed": hung})
