"""`pagedserve status`: live models, engines, their load, and how far the streams lag, read from Redis.

    MODEL   ENGINE   STATE  RUNNING  WAITING  KV USED  AGE
    ...
    MODEL   STREAM   GROUP  BACKLOG  OLDEST WAITING  PENDING  OLDEST PENDING

Backlog: entries the group has not read yet (the queue); pending: read but not acknowledged
(work in progress). Ages come from the entry ids (the time Redis added them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pagedserve.shared import streams
from pagedserve.shared.protocol import DecodeError, EngineHeartbeat, decode_as

_BACKLOG_CAP = 1_000  # Redis < 7 reports no group lag: count entries up to this many


@dataclass(slots=True)
class StreamLag:
    model: str
    stream: str
    group: str
    backlog: int
    oldest_waiting_s: float | None
    pending: int
    oldest_pending_s: float | None


@dataclass(slots=True)
class Status:
    engines: list[EngineHeartbeat]
    streams: list[StreamLag]


def _age(entry_id: Any, now: float) -> float:
    return max(0.0, now - int(_text(entry_id).split("-", 1)[0]) / 1000)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def group_lag(redis: Any, model: str, stream: str, group: str, now: float) -> StreamLag | None:
    try:
        groups = await redis.xinfo_groups(stream)
    except Exception:  # no such stream yet
        return None
    info = next((g for g in groups if _text(g["name"]) == group), None)
    if info is None:
        return None
    after = "(" + _text(info["last-delivered-id"])
    first = await redis.xrange(stream, min=after, max="+", count=1)
    lag = info.get("lag")  # Redis >= 7; None when unknown
    if lag is not None:
        backlog = int(lag)
    else:  # count the unread entries themselves, up to a cap (a scrape must stay cheap)
        backlog = len(await redis.xrange(stream, min=after, max="+", count=_BACKLOG_CAP)) if first else 0
    summary = await redis.xpending(stream, group)
    pending = int(summary["pending"])
    return StreamLag(
        model,
        stream,
        group,
        backlog,
        _age(first[0][0], now) if first else None,
        pending,
        _age(summary["min"], now) if pending else None,
    )


async def collect(redis: Any) -> Status:
    now = time.time()
    engines = []
    keys = [k async for k in redis.scan_iter(match=streams.ENGINE_KEY_PATTERN, count=500)]
    for raw in await redis.mget(keys) if keys else []:
        if raw is None:
            continue
        try:
            engines.append(decode_as(raw, EngineHeartbeat))
        except DecodeError:
            continue
    models = {e.model for e in engines}
    async for key in redis.scan_iter(match=streams.request_stream("*"), count=500):  # models with queued work
        models.add(_text(key).split("{", 1)[1].rsplit("}", 1)[0])
    lags = []
    for model in sorted(models):
        for stream, group in (
            (streams.request_stream(model), streams.TOKENIZER_GROUP),
            (streams.generate_stream(model), streams.engine_group(model)),
        ):
            lag = await group_lag(redis, model, stream, group, now)
            if lag is not None:
                lags.append(lag)
    engines.sort(key=lambda e: (e.model, e.engine_id))
    return Status(engines, lags)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


def render(status: Status, now: float | None = None) -> str:
    now = time.time() if now is None else now
    engine_rows = [
        [
            e.model,
            e.engine_id,
            "draining" if e.is_draining else "live",
            str(e.num_running),
            str(e.num_waiting),
            f"{100 * (1 - e.num_free_blocks / e.num_total_blocks):.0f}%" if e.num_total_blocks else "-",
            _seconds(now - e.time if e.time else None),
        ]
        for e in status.engines
    ]
    stream_rows = [
        [
            s.model,
            s.stream,
            s.group,
            str(s.backlog) + ("+" if s.backlog >= _BACKLOG_CAP else ""),
            _seconds(s.oldest_waiting_s),
            str(s.pending),
            _seconds(s.oldest_pending_s),
        ]
        for s in status.streams
    ]
    live = sorted({e.model for e in status.engines if not e.is_draining})
    return "\n\n".join(
        [
            f"models live: {', '.join(live) if live else 'none'}",
            _table(["MODEL", "ENGINE", "STATE", "RUNNING", "WAITING", "KV USED", "HEARTBEAT AGE"], engine_rows),
            _table(["MODEL", "STREAM", "GROUP", "BACKLOG", "OLDEST WAITING", "PENDING", "OLDEST PENDING"], stream_rows),
        ]
    )


async def status_text(redis_url: str) -> str:
    redis = streams.connect(redis_url)
    try:
        return render(await collect(redis))
    finally:
        await redis.aclose()
