"""Which models have live engines, read from the engines' heartbeat records (keys with a TTL)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from shared import streams
from shared.protocol import DecodeError, EngineHeartbeat, decode_as

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelEntry:
    name: str
    engines: list[EngineHeartbeat] = field(default_factory=list)
    first_seen: float = field(default_factory=time.time)

    @property
    def is_live(self) -> bool:
        return any(not e.is_draining for e in self.engines)

    @property
    def model_source(self) -> str | None:
        return self.engines[0].model_source if self.engines else None

    @property
    def max_model_len(self) -> int:
        return max((e.max_model_len for e in self.engines), default=0)


class ModelRegistry:
    def __init__(self, redis: Any, refresh_s: float) -> None:
        self.redis, self.refresh_s = redis, refresh_s
        self.models: dict[str, ModelEntry] = {}  # every model ever seen; engines = the live ones
        self.is_redis_up = False

    def live_models(self) -> list[ModelEntry]:
        return [m for m in self.models.values() if m.is_live]

    def get(self, name: str) -> ModelEntry | None:
        return self.models.get(name)

    async def refresh(self) -> None:
        keys = [k async for k in self.redis.scan_iter(match=streams.ENGINE_KEY_PATTERN, count=500)]
        values = await self.redis.mget(keys) if keys else []
        for entry in self.models.values():
            entry.engines = []
        for raw in values:
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                beat = decode_as(raw, EngineHeartbeat)
            except DecodeError as exc:
                log.error("skipping a bad heartbeat record: %s", exc)
                continue
            entry = self.models.setdefault(beat.model, ModelEntry(beat.model))
            entry.engines.append(beat)
        self.is_redis_up = True

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # Redis down: keep the last view but report not ready
                if self.is_redis_up:
                    log.warning("registry refresh failed: %s", exc)
                self.is_redis_up = False
                for entry in self.models.values():
                    entry.engines = []
            await asyncio.sleep(self.refresh_s)
