"""Reliability scenarios 1 and 5: an engine replica killed (SIGKILL) or stopped (SIGTERM) mid-stream
under load. Killed: its streams go on on the other replica. Stopped: it takes no new work, finishes
what it holds and exits cleanly. Either way no client loses or sees repeated tokens, and nothing stays
pending in Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest
import redis

from pagedserve.shared import streams
from pagedserve.shared.protocol import EngineHeartbeat, decode_as
from tests.conftest import RunningServices, start_service, stop_all
from tests.e2e.checks import wait_nothing_pending

PROMPTS = [
    f"Write a long story about a {thing}."
    for thing in ("cat", "dog", "ship", "tree", "robot", "river", "castle", "comet")
]
MAX_TOKENS = 48


def _heartbeat(r: redis.Redis, model: str, engine_id: str) -> EngineHeartbeat | None:
    raw = r.get(streams.engine_key(model, engine_id))
    return None if raw is None else decode_as(raw, EngineHeartbeat)


@pytest.mark.parametrize(
    ("sig", "exit_code"), [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 0)], ids=["sigkill", "sigterm"]
)
def test_losing_a_replica_mid_stream_loses_and_repeats_nothing(
    services: RunningServices, sig: signal.Signals, exit_code: int
) -> None:
    base_url = f"{services.base_url}/v1"

    async def ask(client: openai.AsyncOpenAI, prompt: str, stream: bool, salt: str) -> str:
        kwargs = {
            "model": services.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
            # Each run its own prefix-cache salt: the cache-aware router would otherwise send every prompt to the
            # engine that served them in the reference run, and the extra replica would get none to lose.
            "extra_body": {"ignore_eos": True, "cache_salt": salt},
        }
        if not stream:
            reply = await client.chat.completions.create(**kwargs)
            return reply.choices[0].message.content or ""
        parts: list[str] = []
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            parts.extend(c.delta.content or "" for c in chunk.choices)
        return "".join(parts)

    async def run(salt: str) -> list[str]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300) as client:
            return list(await asyncio.gather(*(ask(client, p, stream=True, salt=salt) for p in PROMPTS)))

    expected = asyncio.run(run("reference"))  # the greedy answers with one healthy engine

    r = redis.Redis.from_url(services.redis_url)
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": services.redis_url}
    replica_id = f"eng-doomed-{sig.name.lower()}"
    replica = start_service(
        "doomed-engine",
        [
            "engine",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--cpu-threads",
            "1",
            "--max-model-len",
            "2048",
            "--engine-id",
            replica_id,
            "--heartbeat-ttl-s",
            "3",
        ],
        env,
        services.log_dir,
    )
    try:
        deadline = time.monotonic() + 120
        while _heartbeat(r, services.model, replica_id) is None:
            assert replica.poll() is None and time.monotonic() < deadline, "the extra replica did not start"
            time.sleep(0.2)

        async def kill_when_busy() -> None:
            while True:  # wait until the replica is generating for some of the requests, then kill it
                beat = _heartbeat(r, services.model, replica_id)
                if beat is not None and beat.num_running > 0:
                    await asyncio.sleep(0.5)
                    replica.send_signal(sig)
                    return
                await asyncio.sleep(0.05)

        async def scenario() -> list[str]:
            killer = asyncio.create_task(kill_when_busy())
            answers = await run(f"fault-{sig.name}")
            await asyncio.wait_for(killer, timeout=5)
            return answers

        answers = asyncio.run(scenario())
        assert replica.wait(timeout=40) == exit_code
        assert answers == expected

        wait_nothing_pending(services.redis_url, services.model)  # the dead consumer's entries are claimed
    finally:
        stop_all({"doomed-engine": replica})
        r.close()
