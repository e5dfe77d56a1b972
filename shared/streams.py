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


def engine_stream(model: str, engine_id: str) -> str:
    """One engine's own stream: requests a router sent it for the prefix it holds (read with the model's
    engine group, so a replica that takes over a dead one's stream continues where it stopped)."""
    return f"ps:{{{model}}}:gen:{engine_id}"


def engine_stream_pattern(model: str) -> str:
    """SCAN pattern of every engine stream of `model`: where surviving replicas look for orphaned work."""
    return engine_stream(glob_escape(model), "*")


def glob_escape(text: str) -> str:
    """`text` matched literally in a SCAN pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def kv_events_stream(model: str) -> str:
    return f"ps:{{{model}}}:kv"


def control_stream(model: str) -> str:
    return f"ps:{{{model}}}:ctl"


def response_stream(gateway_id: str) -> str:
    return f"ps:{{{gateway_id}}}:resp"


def engine_group(model: str) -> str:
    return f"engines:{model}"


def lora_key(model: str) -> str:
    """A hash of the adapters loaded at run time (name -> path): a replica started later loads them too."""
    return f"ps:{{{model}}}:loras"


def engine_key(model: str, engine_id: str) -> str:
    return f"ps:{{{model}}}:engine:{engine_id}"


def tokenizer_key(model: str, tokenizer_id: str) -> str:
    return f"ps:{{{model}}}:tokenizer:{tokenizer_id}"


def gateway_key(gateway_id: str) -> str:
    """A gateway process's record: a TTL it refreshes, holding an id of the process (a worker that replaces a
    dead one keeps the gateway id). Engines stop the requests of a gateway whose process is gone."""
    return f"ps:{{{gateway_id}}}:gateway"


GATEWAY_BEAT_S = 1.0  # how often a gateway refreshes its record
GATEWAY_TTL_S = 3.0  # and its lifetime: a killed gateway's record is gone this long after its last beat


def aborted_key(model: str, request_id: str) -> str:
    """A short-lived record that the gateway gave up on `request_id` (see `aborted_ids`)."""
    return f"ps:{{{model}}}:aborted:{request_id}"


def stored_response_key(response_id: str) -> str:
    """A /v1/responses response kept for `previous_response_id` and GET (services/gateway/response_store.py)."""
    return f"ps:{{{response_id}}}:response"


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
    stream: str = ""  # which of the reader's streams it came from


class GroupReader:
    """Reads one or more streams (one XREADGROUP for all: nothing waits on another's timeout) as one
    consumer of a consumer group of the same name on each."""

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str | Sequence[str],
        group: str,
        consumer: str,
        *,
        claim_idle_ms: int = 60_000,
        heartbeat_key: Callable[[str], str] | None = None,
        dead_grace_ms: int = 2_000,
        prune_idle_ms: int = 60_000,
    ) -> None:
        """`heartbeat_key(consumer)`: the key a live consumer keeps alive (a TTL it refreshes); once it
        is gone, that consumer's entries idle for `dead_grace_ms` are claimed without waiting
        `claim_idle_ms` (claim_dead). The grace spares a consumer that started but has not beaten yet."""
        self.streams = [stream] if isinstance(stream, str) else list(stream)
        self.stream = self.streams[0]  # the main one: acks and claims default to it
        self.redis, self.group, self.consumer = redis, group, consumer
        self.claim_idle_ms = claim_idle_ms
        self.heartbeat_key, self.dead_grace_ms = heartbeat_key, dead_grace_ms
        self.prune_idle_ms = prune_idle_ms
        self._reading_pending = True  # re-read our own pending entries first (after a restart)
        self.next_claim = 0.0  # monotonic time of the next claim_stale_if_due that asks Redis

    async def ensure_group(self) -> None:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read(self, count: int = 16, block_ms: int | None = 1000) -> list[Entry]:
        """Up to `count` decoded entries; [] on timeout (`block_ms` None: at once). Garbage is acked and
        skipped here."""
        start = "0" if self._reading_pending else ">"
        try:
            reply: Any = await self.redis.xreadgroup(
                self.group,
                self.consumer,
                dict.fromkeys(self.streams, start),
                count=count,
                block=None if self._reading_pending else block_ms,
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("group %s on %s is gone; recreating it", self.group, ", ".join(self.streams))
            await self.ensure_group()
            return []
        raw = [(_text(stream), eid, fields) for stream, items in reply for eid, fields in items]
        if self._reading_pending and not raw:
            self._reading_pending = False
        return await self._decode(raw)

    async def claim_stale(self, count: int = 16) -> list[Entry]:
        """Take over entries that a dead consumer left pending for longer than claim_idle_ms."""
        claimed: list[tuple[str, bytes, dict[bytes, bytes] | None]] = []
        for stream in self.streams:
            try:
                reply: Any = await self.redis.xautoclaim(
                    stream, self.group, self.consumer, min_idle_time=self.claim_idle_ms, count=count
                )
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.ensure_group()
                continue
            taken = [(stream, eid, fields) for eid, fields in reply[1] if fields is not None]
            if taken:
                log.info("claimed %d stale entries on %s", len(taken), stream)
            claimed.extend(taken)
        return await self._decode(claimed)

    async def claim_dead(self, count: int = 16) -> list[Entry]:
        """Take over the pending entries of consumers whose heartbeat key is gone (hung or dead), at
        once rather than after claim_idle_ms. A consumer whose key exists keeps its entries however
        slow it is; entries idle less than dead_grace_ms are left alone."""
        claimed: list[tuple[str, bytes, dict[bytes, bytes] | None]] = []
        for stream in self.streams:
            claimed.extend(await self._claim_dead_on(stream, count))
        return await self._decode(claimed)

    async def _claim_dead_on(self, stream: str, count: int) -> list[tuple[str, bytes, dict[bytes, bytes] | None]]:
        if self.heartbeat_key is None:
            return []
        try:
            consumers: Any = await self.redis.xinfo_consumers(stream, self.group)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return []  # read() recreates the group
        claimed: list[tuple[str, bytes, dict[bytes, bytes] | None]] = []
        for info in consumers:
            name = info["name"].decode() if isinstance(info["name"], bytes) else str(info["name"])
            if name == self.consumer:
                continue
            if not info["pending"]:
                # A replica gone for good (a new id each start) would be listed here every second forever:
                # drop it once it has nothing pending and has not read for prune_idle_ms (a live one
                # reads every second; one that comes back is re-created by its next read).
                if info["idle"] > self.prune_idle_ms and not await self.redis.exists(self.heartbeat_key(name)):
                    await self.redis.xgroup_delconsumer(stream, self.group, name)
                    log.info("removed consumer %s from %s: gone, nothing pending", name, stream)
                continue
            if await self.redis.exists(self.heartbeat_key(name)):
                continue
            pending: Any = await self.redis.xpending_range(
                stream, self.group, "-", "+", count, consumername=name, idle=self.dead_grace_ms
            )
            ids = [p["message_id"] for p in pending]
            if ids:  # min_idle_time: an entry its owner touched meanwhile (it came back) stays with it
                reply: Any = await self.redis.xclaim(
                    stream, self.group, self.consumer, min_idle_time=self.dead_grace_ms, message_ids=ids
                )
                taken = [(stream, eid, fields) for eid, fields in reply if fields is not None]
                log.warning("consumer %s has no heartbeat: claimed %d of its entries on %s", name, len(taken), stream)
                claimed.extend(taken)
        return claimed

    async def claim_stale_if_due(self, count: int = 16, interval_s: float = 1.0) -> list[Entry]:
        """claim_dead, then claim_stale, at most every `interval_s`: a dead consumer's entries wait for
        its heartbeat to expire or claim_idle_ms anyway, so asking on every read would only add a round
        trip to every request's path."""
        if time.monotonic() < self.next_claim:
            return []
        self.next_claim = time.monotonic() + interval_s
        dead = await self.claim_dead(count)
        return dead + await self.claim_stale(count)

    async def refresh_claims(self, entry_ids: Sequence[bytes | str], stream: str | None = None) -> None:
        """Reset the idle time of entries we are still working on (on `stream`, default the main one), so
        nobody claims them."""
        if not entry_ids:
            return
        try:
            await self.redis.xclaim(
                stream or self.stream,
                self.group,
                self.consumer,
                min_idle_time=0,
                message_ids=list(entry_ids),
                justid=True,
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise  # NOGROUP: Redis lost the group, and the entries with it; read() recreates it

    async def ack(self, *entry_ids: bytes, stream: str | None = None) -> None:
        if entry_ids:
            await self.redis.xack(stream or self.stream, self.group, *entry_ids)

    async def _decode(self, raw: list[tuple[str, bytes, dict[bytes, bytes] | None]]) -> list[Entry]:
        entries = []
        for stream, eid, fields in raw:
            try:
                entries.append(Entry(eid, decode((fields or {}).get(DATA_FIELD, b"")), stream))
            except DecodeError as exc:
                log.error("skipping undecodable entry %s on %s: %s", eid, stream, exc)
                await self.ack(eid, stream=stream)
        return entries


def _text(name: bytes | str) -> str:
    return name.decode() if isinstance(name, bytes) else name


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
