"""Redis Streams plumbing shared by the services: names, publishing, and a consumer-group reader.

Delivery is at least once. A reader first re-reads its own pending entries (work it had taken
before a restart), then new ones; entries that do not decode are logged, acknowledged and
skipped; a lost group (Redis restarted, stream deleted) is recreated; entries pending on a dead
consumer for longer than `claim_idle_ms` are claimed. Callers XACK only when a request reached a
terminal state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.protocol import DecodeError, Message, decode, encode

log = logging.getLogger(__name__)

DATA_FIELD = b"d"
TOKENIZER_GROUP = "tokenizers"


def request_stream(model: str) -> str:
    return f"ps:req:{model}"


def generate_stream(model: str) -> str:
    return f"ps:gen:{model}"


def control_stream(model: str) -> str:
    return f"ps:ctl:{model}"


def response_stream(gateway_id: str) -> str:
    return f"ps:resp:{gateway_id}"


def engine_group(model: str) -> str:
    return f"engines:{model}"


def engine_key(model: str, engine_id: str) -> str:
    return f"ps:engine:{model}:{engine_id}"


ENGINE_KEY_PATTERN = "ps:engine:*"


def connect(url: str, max_connections: int = 16) -> aioredis.Redis:
    """A client whose pool holds at most `max_connections`; a command beyond them waits for a free
    connection (up to the socket timeout) instead of failing with "Too many connections"."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=10, decode_responses=False, health_check_interval=10,
        socket_connect_timeout=2, socket_timeout=10,
    )
    return aioredis.Redis.from_pool(pool)  # owns the pool: aclose() closes it


async def publish(redis: aioredis.Redis, stream: str, msg: Message, maxlen: int = 100_000) -> bytes:
    """XADD one message, trimming the stream approximately so it never grows without bound."""
    entry_id: Any = await redis.xadd(stream, {DATA_FIELD: encode(msg)}, maxlen=maxlen, approximate=True)
    return bytes(entry_id)


@dataclass(slots=True)
class Entry:
    entry_id: bytes
    message: Message


class GroupReader:
    """Reads one stream as one consumer of a consumer group."""

    def __init__(
        self, redis: aioredis.Redis, stream: str, group: str, consumer: str, *, claim_idle_ms: int = 60_000
    ) -> None:
        self.redis, self.stream, self.group, self.consumer = redis, stream, group, consumer
        self.claim_idle_ms = claim_idle_ms
        self._reading_pending = True  # re-read our own pending entries first (after a restart)
        self._next_claim = 0.0  # monotonic time of the next claim_stale_if_due that asks Redis

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int = 16, block_ms: int = 1000) -> list[Entry]:
        """Up to `count` decoded entries; [] on timeout. Garbage is acked and skipped here."""
        start = "0" if self._reading_pending else ">"
        try:
            reply: Any = await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: start}, count=count,
                block=None if self._reading_pending else block_ms,
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("group %s on %s is gone; recreating it", self.group, self.stream)
            await self.ensure_group()
            return []
        raw = [(eid, fields) for _, items in reply for eid, fields in items]
        if self._reading_pending and not raw:
            self._reading_pending = False
        return await self._decode(raw)

    async def claim_stale(self, count: int = 16) -> list[Entry]:
        """Take over entries that a dead consumer left pending for longer than claim_idle_ms."""
        try:
            reply: Any = await self.redis.xautoclaim(
                self.stream, self.group, self.consumer, min_idle_time=self.claim_idle_ms, count=count
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await self.ensure_group()
            return []
        claimed = [(eid, fields) for eid, fields in reply[1] if fields is not None]
        if claimed:
            log.info("claimed %d stale entries on %s", len(claimed), self.stream)
        return await self._decode(claimed)

    async def claim_stale_if_due(self, count: int = 16, interval_s: float = 1.0) -> list[Entry]:
        """claim_stale at most every `interval_s`: a dead consumer's entries wait claim_idle_ms anyway,
        so asking on every read would only add a round trip to every request's path."""
        if time.monotonic() < self._next_claim:
            return []
        self._next_claim = time.monotonic() + interval_s
        return await self.claim_stale(count)

    async def refresh_claims(self, entry_ids: Sequence[bytes | str]) -> None:
        """Reset the idle time of entries we are still working on, so nobody claims them."""
        if not entry_ids:
            return
        try:
            await self.redis.xclaim(
                self.stream, self.group, self.consumer, min_idle_time=0, message_ids=list(entry_ids), justid=True
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise  # NOGROUP: Redis lost the group, and the entries with it; read() recreates it

    async def ack(self, *entry_ids: bytes) -> None:
        if entry_ids:
            await self.redis.xack(self.stream, self.group, *entry_ids)

    async def _decode(self, raw: list[tuple[bytes, dict[bytes, bytes] | None]]) -> list[Entry]:
        entries, garbage = [], []
        for eid, fields in raw:
            try:
                entries.append(Entry(eid, decode((fields or {}).get(DATA_FIELD, b""))))
            except DecodeError as exc:
                log.error("skipping undecodable entry %s on %s: %s", eid, self.stream, exc)
                garbage.append(eid)
        await self.ack(*garbage)
        return entries
