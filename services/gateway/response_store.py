"""Stored /v1/responses responses: in Redis with a TTL, so every gateway worker and replica shares them.

    store=true  ─► save(response, input items)      one key per response (streams.stored_response_key)
    GET    /v1/responses/{id}  ─► load(id).response           (/input_items: load(id).input_items)
    DELETE /v1/responses/{id}  ─► delete(id)
    previous_response_id       ─► load(id).conversation(): its input items (its own history first) and its
                                   output items, the history before the new input

A response keeps its whole history, so a chain is read with one GET however long it is (instructions are
not carried over, as OpenAI's). Records are JSON of our own making: nothing is ever unpickled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from pagedserve.services.gateway.errors import APIError
from pagedserve.shared import streams

log = logging.getLogger(__name__)
_REDIS_ERRORS = (RedisError, OSError)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]  # every item before its output: the history it continued, then its input

    def conversation(self) -> list[dict[str, Any]]:
        return [*self.input_items, *self.response["output"]]


class ResponseStore:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self.redis, self.ttl_s = redis, ttl_s

    @property
    def is_enabled(self) -> bool:
        return self.ttl_s > 0

    async def save(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Keep `response` for ttl_s. A Redis failure is logged, not raised: the answer is already made, and
        only a later GET or continuation of it will miss (404)."""
        record = orjson.dumps({"response": response, "input": input_items})
        try:
            await self.redis.set(streams.stored_response_key(response["id"]), record, ex=self.ttl_s)
        except _REDIS_ERRORS as exc:
            log.warning("response %s not stored: %s", response["id"], exc)

    async def load(self, response_id: str) -> StoredResponse | None:
        try:
            record = await self.redis.get(streams.stored_response_key(response_id))
        except _REDIS_ERRORS as exc:
            log.warning("stored response %s not read: %s", response_id, exc)
            raise _unavailable() from None
        if record is None:
            return None
        data = orjson.loads(record)
        return StoredResponse(data["response"], data["input"])

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self.redis.delete(streams.stored_response_key(response_id)))
        except _REDIS_ERRORS as exc:
            log.warning("stored response %s not deleted: %s", response_id, exc)
            raise _unavailable() from None


def not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return APIError(404, f"{what} with id '{response_id}' not found.", param=param, code=code)


def _unavailable() -> APIError:
    return APIError(503, "the response store (Redis) is unavailable; retry shortly", retry_after=2)
