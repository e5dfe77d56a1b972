"""Which models have live engines and tokenizers, read from their heartbeat records (keys with a TTL)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedserve.shared import streams
from pagedserve.shared.protocol import DecodeError, EngineHeartbeat, TokenizerHeartbeat, decode_as

log = logging.getLogger(__name__)
T = TypeVar("T")
_SETTLE_S = 3.0  # engines beat every second (heartbeat_interval_s); a few beats of margin


@dataclass(slots=True)
class ModelEntry:
    name: str
    engines: list[EngineHeartbeat] = field(default_factory=list)
    tokenizers: list[TokenizerHeartbeat] = field(default_factory=list)
    first_seen: float = field(default_factory=time.time)

    @property
    def is_live(self) -> bool:
        return any(not e.is_draining for e in self.engines)

    @property
    def is_servable(self) -> bool:
        """A request for it would run now: a live engine and a tokenizer service to prepare the prompt."""
        return self.is_live and bool(self.tokenizers)

    @property
    def is_pooling(self) -> bool:
        """Its engines serve embeddings (--runner pooling), not text generation."""
        return any(e.runner == "pooling" for e in self.engines)

    @property
    def model_source(self) -> str | None:
        return self.engines[0].model_source if self.engines else None

    @property
    def adapters(self) -> dict[str, str]:
        """LoRA adapters its live engines serve: name -> path."""
        served: dict[str, str] = {}
        for engine in self.engines:
            if not engine.is_draining:
                served.update(engine.lora_adapters)
        return served

    @property
    def max_lora_rank(self) -> int:
        """The largest adapter rank every live engine takes (0: some serve no adapters)."""
        return min((e.max_lora_rank for e in self.engines if not e.is_draining), default=0)

    @property
    def max_model_len(self) -> int:
        """The context every live engine serves (the smallest limit): what a request is checked against."""
        return min((e.max_model_len for e in self.engines if not e.is_draining), default=0)


class ModelRegistry:
    def __init__(self, redis: Any, refresh_s: float) -> None:
        self.redis, self.refresh_s = redis, refresh_s
        self.models: dict[str, ModelEntry] = {}  # every model ever seen; engines = the live ones
        self.is_redis_up = False
        self.has_been_up = False
        self.up_since = -float("inf")  # when Redis last came back after an outage (the first start is none)

    def is_settled(self) -> bool:
        """Redis is up and has been long enough for every live engine to have beaten since: a Redis that
        restarted empty holds no engine records for up to a heartbeat, and their absence means nothing."""
        return self.is_redis_up and time.monotonic() - self.up_since >= _SETTLE_S

    def live_models(self) -> list[ModelEntry]:
        return [m for m in self.models.values() if m.is_live]

    def servable_models(self) -> list[ModelEntry]:
        return [m for m in self.models.values() if m.is_servable]

    def get(self, name: str) -> ModelEntry | None:
        return self.models.get(name)

    async def refresh(self) -> None:
        engines = await self._read(streams.ENGINE_KEY_PATTERN, EngineHeartbeat)
        tokenizers = await self._read(streams.TOKENIZER_KEY_PATTERN, TokenizerHeartbeat)
        for entry in self.models.values():
            entry.engines, entry.tokenizers = [], []
        for beat in engines:
            self.models.setdefault(beat.model, ModelEntry(beat.model)).engines.append(beat)
        for tokenizer in tokenizers:
            self.models.setdefault(tokenizer.model, ModelEntry(tokenizer.model)).tokenizers.append(tokenizer)
        if not self.is_redis_up and self.has_been_up:
            self.up_since = time.monotonic()
        self.is_redis_up = self.has_been_up = True

    async def refresh_now(self) -> None:
        """Read the heartbeats now, for an answer about which models are served: each gateway worker
        refreshes on its own schedule, and a worker a second behind another would list a model the other
        already listed as absent (a client polling /v1/models across workers saw it appear and vanish).
        A failed read keeps the last view and marks Redis down, as the periodic refresh does."""
        try:
            await self.refresh()
        except Exception as exc:
            log.warning("registry refresh failed: %s", exc)
            self.is_redis_up = False

    def base_of(self, adapter: str) -> ModelEntry | None:
        """The model whose engines serve the LoRA adapter `adapter` (None: no model does)."""
        return next((m for m in self.models.values() if m.is_live and adapter in m.adapters), None)

    async def resolve(self, name: str) -> tuple[ModelEntry | None, str | None]:
        """A request's `model`: (the model, None), or (its base model, the adapter) when it names a LoRA adapter
        (as vLLM: an adapter is a model of its own to clients)."""
        entry = await self.get_fresh(name)
        if entry is not None and entry.engines:
            return entry, None
        base = self.base_of(name)
        return (base, name) if base is not None else (entry, None)

    async def get_fresh(self, name: str) -> ModelEntry | None:
        """`get`, re-reading the heartbeats first when the cached view does not serve the model."""
        entry = self.models.get(name)
        if entry is None or not entry.is_servable:
            await self.refresh_now()
            entry = self.models.get(name)
        return entry

    async def _read(self, pattern: str, cls: type[T]) -> list[T]:
        keys = [k async for k in self.redis.scan_iter(match=pattern, count=500)]
        beats = []
        for raw in await self.redis.mget(keys) if keys else []:
            if raw is None:  # expired between SCAN and MGET
                continue
            try:
                beats.append(decode_as(raw, cls))
            except DecodeError as exc:
                log.error("skipping a bad heartbeat record: %s", exc)
        return beats

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as exc:  # Redis down: keep the last view but report not ready
                if self.is_redis_up:
                    log.warning("registry refresh failed: %s", exc)
                self.is_redis_up = False
                for entry in self.models.values():
                    entry.engines, entry.tokenizers = [], []
            await asyncio.sleep(self.refresh_s)
