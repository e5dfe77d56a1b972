"""Redis Streams plumbing shared by the services: names, publishing, and a consumer-group reader.

Delivery is at least once. A reader first re-reads its own pending entries (work it had taken
before a restart), then new ones; entries that do not decode are logged, acknowledged and
skipped; a lost group (Redis restarted, stream deleted) is recreated; entries pending on a dead
consumer for longer than `claim_idle_ms` are claimed, and where the reader knows its peers'
heartbeat keys, those of a consumer whose key is gone are claimed at once. Callers XACK only when a
request reached a terminal state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pagedserve.shared import redis_connect
from pagedserve.shared.protocol import DecodeError, Message, decode, encode

log = logging.getLogger(__name__)

DATA_FIELD = b"d"
TOKENIZER_GROUP = "tokenizers"


# Key names carry a hash tag (`{model}`, `{gateway_id}`): all keys of one model land in one slot,
# so a Redis Cluster can spread many models over its nodes.
def request_stream(model: str) -> str:
    return f"ps:{{{model}}}:req"


def generate_stream(model: str) -> str:
    return f"ps:{{{model}}}:gen"


def control_stream(model: str) -> str:
    return f"ps:{{{model}}}:ctl"


def response_stream(gateway_id: str) -> str:
    return f"ps:{{{gateway_id}}}:resp"


def engine_group(model: str) -> str:
    return f"engines:{model}"


def engine_key(model: str, engine_id: str) -> str:
    return f"ps:{{{model}}}:engine:{engine_id}"


def tokenizer_key(model: str, tokenizer_id: str) -> str:
    return f"ps:{{{model}}}:tokenizer:{tokenizer_id}"


def aborted_key(model: str, request_id: str) -> str:
    """A short-lived record that the gateway gave up on `request_id` (see `aborted_ids`)."""
    return f"ps:{{{model}}}:aborted:{request_id}"


ENGINE_KEY_PATTERN = "ps:*:engine:*"
TOKENIZER_KEY_PATTERN = "ps:*:tokenizer:*"
RESPONSE_STREAM_PATTERN = "ps:*:resp"


def connect(url: str, max_connections: int = 16) -> aioredis.Redis:
    """Every service's Redis client: `redis://...` or `redis+sentinel://...` (see shared/redis_connect.py),
    with at most `max_connections` pooled connections."""
    return redis_connect.connect(url, max_connections)


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
        self,
        redis: aioredis.Redis,
        stream: str,
        group: str,
        consumer: str,
        *,
        claim_idle_ms: int = 60_000,
        heartbeat_key: Callable[[str], str] | None = None,
        dead_grace_ms: int = 2_000,
    ) -> None:
        """`heartbeat_key(consumer)`: the key a live consumer keeps alive (a TTL it refreshes); once it
        is gone, that consumer's entries idle for `dead_grace_ms` are claimed without waiting
        `claim_idle_ms` (claim_dead). The grace spares a consumer that started but has not beaten yet."""
        self.redis, self.stream, self.group, self.consumer = redis, stream, group, consumer
        self.claim_idle_ms = claim_idle_ms
        self.heartbeat_key, self.dead_grace_ms = heartbeat_key, dead_grace_ms
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
                self.group,
                self.consumer,
                {self.stream: start},
                count=count,
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

    async def claim_dead(self, count: int = 16) -> list[Entry]:
        """Take over the pending entries of consumers whose heartbeat key is gone (hung or dead), at
        once rather than after claim_idle_ms. A consumer whose key exists keeps its entries however
        slow it is; entries idle less than dead_grace_ms are left alone."""
        if self.heartbeat_key is None:
            return []
        try:
            consumers: Any = await self.redis.xinfo_consumers(self.stream, self.group)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return []  # read() recreates the group
        claimed: list[tuple[bytes, dict[bytes, bytes] | None]] = []
        for info in consumers:
            name = info["name"].decode() if isinstance(info["name"], bytes) else str(info["name"])
            if name == self.consumer or not info["pending"] or await self.redis.exists(self.heartbeat_key(name)):
                continue
            pending: Any = await self.redis.xpending_range(
                self.stream, self.group, "-", "+", count, consumername=name, idle=self.dead_grace_ms
            )
            ids = [p["message_id"] for p in pending]
            if ids:  # min_idle_time: an entry its owner touched meanwhile (it came back) stays with it
                reply: Any = await self.redis.xclaim(
                    self.stream, self.group, self.consumer, min_idle_time=self.dead_grace_ms, message_ids=ids
                )
                taken = [(eid, fields) for eid, fields in reply if fields is not None]
                log.warning(
                    "consumer %s has no heartbeat: claimed %d of its entries on %s", name, len(taken), self.stream
                )
                claimed.extend(taken)
        return await self._decode(claimed)

    async def claim_stale_if_due(self, count: int = 16, interval_s: float = 1.0) -> list[Entry]:
        """claim_dead, then claim_stale, at most every `interval_s`: a dead consumer's entries wait for
        its heartbeat to expire or claim_idle_ms anyway, so asking on every read would only add a round
        trip to every request's path."""
        if time.monotonic() < self._next_claim:
            return []
        self._next_claim = time.monotonic() + interval_s
        dead = await self.claim_dead(count)
        return dead + await self.claim_stale(count)

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


async def aborted_ids(redis: aioredis.Redis, model: str, request_ids: Sequence[str]) -> set[str]:
    """Which of `request_ids` were aborted (a record set by the gateway's abort, kept abort_record_ttl_s).

    Why a record and not only the control stream: a tokenizer or engine that was down, or had not read the
    request yet, when the abort went out must still see it before it starts the work. One round trip per
    batch of new requests; a record outlives any request wait the gateway allows."""
    if not request_ids:
        return set()
    async with redis.pipeline(transaction=False) as pipe:
        for request_id in request_ids:
            pipe.exists(aborted_key(model, request_id))
        found = await pipe.execute()
    return {request_id for request_id, hit in zip(request_ids, found) if hit}
