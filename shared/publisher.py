"""Batched XADDs: many coroutines publish, one pipeline round trip carries them all.

    request coroutines ──publish()──► pending list ──► run(): one pipelined XADD batch at a time
                          (await their own future)       (one connection, whatever the concurrency)

A gateway with 2,048 requests in flight would otherwise hold one pooled connection per concurrent
XADD; here the publishes that arrive while a batch is on the wire simply ride the next one, so the
batch size grows with the load and a lone publish still goes out at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from pagedserve.shared.protocol import Message, encode
from pagedserve.shared.streams import DATA_FIELD

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    stream: str
    payload: bytes
    maxlen: int
    done: asyncio.Future[bytes]


class Publisher:
    def __init__(self, redis: Any, max_batch: int = 1024) -> None:
        self.redis = redis
        self.max_batch = max_batch
        self._pending: list[_Pending] = []
        self._wakeup = asyncio.Event()
        self.num_batches = 0  # for tests and metrics: how many round trips carried the publishes

    def send(self, stream: str, msg: Message, maxlen: int = 100_000) -> asyncio.Future[bytes]:
        """Queue an XADD of `msg` now (messages go out in the order they were sent); the future gives
        its entry id, or the Redis error if its batch failed."""
        done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(stream, encode(msg), maxlen, done))
        self._wakeup.set()
        return done

    async def publish(self, stream: str, msg: Message, maxlen: int = 100_000) -> bytes:
        """XADD `msg` (trimming the stream approximately) and wait until Redis has it."""
        return await self.send(stream, msg, maxlen)

    async def run(self) -> None:
        """Send pending publishes until cancelled."""
        while True:
            await self._wakeup.wait()
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            if not self._pending:
                self._wakeup.clear()
            live = [p for p in batch if not p.done.done()]  # a cancelled caller's message is dropped
            if live:
                await self._send(live)

    async def _send(self, batch: list[_Pending]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for p in batch:
            pipe.xadd(p.stream, {DATA_FIELD: p.payload}, maxlen=p.maxlen, approximate=True)
        self.num_batches += 1
        try:
            results = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the connection failed: every caller of this batch gets the error
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(exc)
            return
        for p, result in zip(batch, results):
            if p.done.done():
                continue
            if isinstance(result, Exception):
                p.done.set_exception(result)
            else:
                p.done.set_result(bytes(result))
