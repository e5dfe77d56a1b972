"""The consumer-group reader against a real Redis server."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from pagedserve.shared import streams
from pagedserve.shared.protocol import Abort
from pagedserve.shared.redis_server import PrivateRedis


def run(coro):
    return asyncio.run(coro)


def _names() -> tuple[str, str]:
    return f"test:{uuid.uuid4().hex}", "group"


def test_garbage_is_acked_and_skipped_and_reading_goes_on(redis_server: PrivateRedis) -> None:
    async def go() -> None:
        r = streams.connect(redis_server.url)
        stream, group = _names()
        reader = streams.GroupReader(r, stream, group, "c1")
        await reader.ensure_group()
        await r.xadd(stream, {b"d": b"\xc1 not msgpack"})
        await r.xadd(stream, {b"x": b"no data field"})
        await streams.publish(r, stream, Abort(["ok"]))
        got = []
        for _ in range(3):
            got += await reader.read(count=10, block_ms=100)
        assert [e.message for e in got] == [Abort(["ok"])]
        pending = await r.xpending(stream, group)
        assert pending["pending"] == 1  # only the real message waits for its ack
        await reader.ack(got[0].entry_id)
        assert (await r.xpending(stream, group))["pending"] == 0
        await r.aclose()

    run(go())


def test_a_restarted_consumer_rereads_its_own_pending_entries(redis_server: PrivateRedis) -> None:
    async def go() -> None:
        r = streams.connect(redis_server.url)
        stream, group = _names()
        first = streams.GroupReader(r, stream, group, "same-consumer")
        await first.ensure_group()
        await streams.publish(r, stream, Abort(["a"]))
        await first.read(block_ms=100)
        await first.read(block_ms=100)
        restarted = streams.GroupReader(r, stream, group, "same-consumer")
        again = await restarted.read(block_ms=100)
        assert [e.message for e in again] == [Abort(["a"])]
        await r.aclose()

    run(go())


def test_a_lost_group_is_recreated(redis_server: PrivateRedis) -> None:
    async def go() -> None:
        r = streams.connect(redis_server.url)
        stream, group = _names()
        reader = streams.GroupReader(r, stream, group, "c1")
        await reader.ensure_group()
        await reader.read(block_ms=50)
        await r.delete(stream)  # as after a Redis restart without persistence
        assert await reader.read(block_ms=50) == []
        await streams.publish(r, stream, Abort(["after"]))
        assert [e.message for e in await reader.read(block_ms=100)] == [Abort(["after"])]
        await r.delete(stream)
        await reader.refresh_claims([b"1-0"])  # the group is gone with its entries: nothing to refresh
        await r.aclose()

    run(go())


def test_stale_entries_of_a_dead_consumer_are_claimed(redis_server: PrivateRedis) -> None:
    async def go() -> None:
        r = streams.connect(redis_server.url)
        stream, group = _names()
        dead = streams.GroupReader(r, stream, group, "dead")
        await dead.ensure_group()
        await streams.publish(r, stream, Abort(["orphan"]))
        await dead.read(block_ms=50)
        await dead.read(block_ms=50)
        alive = streams.GroupReader(r, stream, group, "alive", claim_idle_ms=50)
        assert await alive.claim_stale() == []  # not idle long enough yet
        await asyncio.sleep(0.1)
        claimed = await alive.claim_stale()
        assert [e.message for e in claimed] == [Abort(["orphan"])]
        await r.aclose()

    run(go())


def test_entries_of_a_consumer_without_heartbeat_are_claimed_at_once(redis_server: PrivateRedis) -> None:
    async def go() -> None:
        r = streams.connect(redis_server.url)
        stream, group = _names()

        def key(consumer: str) -> str:
            return f"{stream}:hb:{consumer}"

        slow = streams.GroupReader(r, stream, group, "slow")
        await slow.ensure_group()
        await streams.publish(r, stream, Abort(["slow-work"]))
        await slow.read(block_ms=50)  # its own pending entries first (none), then new ones
        await slow.read(block_ms=50)
        await r.set(key("slow"), b"1")  # slow but alive: its heartbeat key is there
        hung = streams.GroupReader(r, stream, group, "hung")
        await streams.publish(r, stream, Abort(["hung-work"]))
        await hung.read(block_ms=50)
        await hung.read(block_ms=50)  # handed an entry, then never beats (or its key expired)
        alive = streams.GroupReader(
            r, stream, group, "alive", claim_idle_ms=60_000, heartbeat_key=key, dead_grace_ms=200
        )
        assert await alive.claim_dead() == []  # within the grace: a consumer just started is spared
        await asyncio.sleep(0.3)
        claimed = await alive.claim_dead()
        assert [e.message for e in claimed] == [Abort(["hung-work"])]  # long before claim_idle_ms
        assert await alive.claim_dead() == []
        owners = {p["name"]: p["pending"] for p in (await r.xpending(stream, group))["consumers"]}
        assert owners == {b"slow": 1, b"alive": 1}  # the slow one keeps its work
        assert await streams.GroupReader(r, stream, group, "plain").claim_dead() == []  # no heartbeat_key: off
        await r.aclose()

    run(go())


def test_a_gone_consumer_with_nothing_pending_is_removed(redis_server: PrivateRedis) -> None:
    async def go() -> None:
        r = streams.connect(redis_server.url)
        stream, group = _names()
        key = lambda consumer: f"{stream}:hb:{consumer}"
        for name in ("gone", "idle-but-alive"):
            reader = streams.GroupReader(r, stream, group, name)
            await reader.ensure_group()
            await reader.read(block_ms=10)
        await r.set(key("idle-but-alive"), b"1")
        survivor = streams.GroupReader(r, stream, group, "survivor", heartbeat_key=key, prune_idle_ms=100)
        await survivor.claim_dead()
        assert len(await r.xinfo_consumers(stream, group)) == 2  # not idle long enough yet
        await asyncio.sleep(0.2)
        await survivor.claim_dead()
        names = {c["name"] for c in await r.xinfo_consumers(stream, group)}
        assert names == {b"idle-but-alive"}  # its heartbeat says it lives, however idle
        await r.aclose()

    run(go())


@pytest.mark.parametrize("maxlen", [50])
def test_publish_trims_the_stream(redis_server: PrivateRedis, maxlen: int) -> None:
    async def go() -> None:
        r = streams.connect(redis_server.url)
        stream, _ = _names()
        for i in range(2000):
            await streams.publish(r, stream, Abort([str(i)]), maxlen=maxlen)
        assert await r.xlen(stream) < 2000 // 4  # approximate trimming keeps it near maxlen
        await r.aclose()

    run(go())
