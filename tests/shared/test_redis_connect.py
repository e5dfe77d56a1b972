"""Redis URLs: plain ones go to redis-py as they are; redis+sentinel:// names sentinels, service and db."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio.sentinel import SentinelConnectionPool

from pagedserve.shared.redis_connect import connect, is_sentinel_url, parse_sentinel_url
from pagedserve.shared.redis_server import PrivateRedis


def test_sentinel_url_parts() -> None:
    spec = parse_sentinel_url(
        "redis+sentinel://:s3cret@10.0.0.1:26379,sentinel-2:26380,sentinel-3/mymaster/2?sentinel_password=watch"
    )
    assert spec.sentinels == [("10.0.0.1", 26379), ("sentinel-2", 26380), ("sentinel-3", 26379)]
    assert (spec.service_name, spec.db, spec.password, spec.sentinel_password) == ("mymaster", 2, "s3cret", "watch")
    assert not spec.ssl and spec.username is None
    assert parse_sentinel_url("rediss+sentinel://user:pw@h:1/m").ssl
    assert parse_sentinel_url("redis+sentinel://h:1/m").db == 0


@pytest.mark.parametrize("url", ["redis+sentinel://h:26379", "redis+sentinel:///m", "redis://h:6379/0"])
def test_bad_sentinel_urls(url: str) -> None:
    with pytest.raises(ValueError):
        parse_sentinel_url(url)


def test_connect_picks_the_client_kind() -> None:
    assert not is_sentinel_url("redis://127.0.0.1:6379/0")
    plain = connect("redis://127.0.0.1:6379/3")
    assert plain.connection_pool.connection_kwargs["db"] == 3
    watched = connect("redis+sentinel://:pw@127.0.0.1:26379/mymaster/1")
    assert isinstance(watched.connection_pool, SentinelConnectionPool)
    assert watched.connection_pool.service_name == "mymaster"
    assert watched.connection_pool.connection_kwargs["db"] == 1
    assert watched.connection_pool.connection_kwargs["password"] == "pw"


def test_a_connection_redis_dropped_is_retried_on_a_new_one() -> None:
    """After a Redis restart the pooled connection is dead: the next command must still go through."""
    server = PrivateRedis().start()
    try:

        async def main() -> None:
            client = connect(server.url)
            try:
                await client.xadd("s", {"d": b"1"})
                port = server.port
                server.stop()
                restarted = PrivateRedis(port=port).start()
                try:
                    await client.xadd("s", {"d": b"2"})  # a stale connection without retries: ConnectionError
                    assert await client.xlen("s") == 1  # no persistence: only the entry written after
                finally:
                    restarted.stop()
            finally:
                await client.aclose()

        asyncio.run(main())
    finally:
        server.stop()
