"""Stored responses on a real Redis: saved with their TTL, read back by any client, deleted once."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.response_store import ResponseStore, not_found
from pagedserve.shared import streams
from pagedserve.shared.redis_server import PrivateRedis


def test_saved_responses_are_shared_and_expire(redis_server: PrivateRedis) -> None:
    async def scenario() -> None:
        writer, reader = streams.connect(redis_server.url), streams.connect(redis_server.url)  # two workers
        try:
            store, other = ResponseStore(writer, ttl_s=60), ResponseStore(reader, ttl_s=60)
            response = {"id": "resp_store1", "object": "response", "output": [{"type": "message", "id": "msg_1"}]}
            history = [{"type": "message", "role": "user", "content": "hi"}]
            await store.save(response, history)
            stored = await other.load("resp_store1")
            assert stored is not None and stored.response == response
            assert stored.conversation() == [*history, *response["output"]]
            assert 0 < await reader.ttl(streams.stored_response_key("resp_store1")) <= 60
            assert await other.delete("resp_store1") is True
            assert await store.load("resp_store1") is None
            assert await store.delete("resp_store1") is False  # already gone: the route answers 404
        finally:
            await writer.aclose()
            await reader.aclose()

    asyncio.run(scenario())


def test_a_store_without_redis_says_503() -> None:
    async def scenario() -> None:
        redis = streams.connect("redis://127.0.0.1:1/0")  # nothing listens there
        try:
            with pytest.raises(APIError) as err:
                await ResponseStore(redis, ttl_s=60).load("resp_x")
            assert err.value.status == 503 and err.value.retry_after is not None
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_unknown_ids_are_openai_404s() -> None:
    error = not_found("resp_nope", param="previous_response_id")
    assert (error.status, error.param, error.code) == (404, "previous_response_id", "previous_response_not_found")
    assert "resp_nope" in error.message and not_found("resp_nope").param is None
