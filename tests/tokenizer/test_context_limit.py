"""The tokenizer's context limit follows the model's live engines (their heartbeats in a real Redis)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from pagedserve.services.tokenizer.service import context_limit, live_engines
from pagedserve.shared import streams
from pagedserve.shared.protocol import EngineHeartbeat, encode
from pagedserve.shared.redis_server import PrivateRedis


def test_the_smallest_live_engine_limit_wins(redis_server: PrivateRedis) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            model = "limit-[test]*"  # glob characters in the name must not match other models
            assert context_limit(await live_engines(client, model)) is None  # no engine up: the model's own limit
            for engine_id, limit, draining in (("a", 4096, False), ("b", 256, False), ("c", 64, True)):
                beat = EngineHeartbeat(engine_id, model, limit, is_draining=draining)
                await client.set(streams.engine_key(model, engine_id), encode(beat), px=10_000)
            other = streams.engine_key("limit-other", "x")
            await client.set(other, encode(EngineHeartbeat("x", "o", 16)), px=10_000)
            assert context_limit(await live_engines(client, model)) == 256  # draining engines take no new work
        finally:  # the Redis is the session's: leave no live engine behind for the gateways of later tests
            await client.delete(*[streams.engine_key(model, e) for e in "abc"], streams.engine_key("limit-other", "x"))
            await client.aclose()

    asyncio.run(main())
