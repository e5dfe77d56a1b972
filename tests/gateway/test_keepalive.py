"""SSE keep-alive comments: sent only while a stream is silent, and closing the stream ends its source."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from pagedserve.services.gateway.streaming import KEEP_ALIVE, with_keepalives


async def slow_then_fast() -> AsyncIterator[bytes]:
    await asyncio.sleep(0.35)  # queued: three intervals of silence
    for _ in range(5):  # then tokens faster than the interval: no comment between them
        await asyncio.sleep(0.02)
        yield b"data: token\n\n"


def test_comments_fill_silence_only() -> None:
    async def run() -> list[tuple[float, bytes]]:
        started = time.monotonic()
        return [(time.monotonic() - started, e) async for e in with_keepalives(slow_then_fast(), 0.1)]

    sent = asyncio.run(run())
    kinds = [e for _, e in sent]
    assert kinds == [KEEP_ALIVE] * 3 + [b"data: token\n\n"] * 5
    gaps = [later - earlier for (earlier, _), (later, _) in zip([(0.0, b""), *sent], sent)]
    assert max(gaps) < 0.1 + 0.05


def test_closing_the_stream_closes_its_source() -> None:
    closed: list[bool] = []

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                await asyncio.sleep(1)
                yield b"x"
        finally:
            closed.append(True)  # Generation.updates() releases the request here

    async def run() -> None:
        stream = with_keepalives(endless(), 0.05)
        assert await anext(stream) == KEEP_ALIVE
        await stream.aclose()  # type: ignore[attr-defined]  # an async generator

    asyncio.run(run())
    assert closed == [True]
