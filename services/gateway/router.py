"""One receiver task reads this gateway's response stream and wakes per-request queues.

Requests register a queue before they are published, so no reply can arrive unseen. TokenDeltas
are columnar (many requests per entry); the router splits them into per-request `Delta`s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedserve.shared import streams
from pagedserve.shared.protocol import Accepted, DecodeError, RequestError, TokenDeltas, decode

log = logging.getLogger(__name__)
_TRIM_INTERVAL_S = 0.5  # trimming is housekeeping: not a round trip between every read and the next


@dataclass(slots=True)
class Delta:
    index: int
    token_ids: list[int]
    logprobs: list[Any] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    engine_id: str
    prompt_logprobs: list[Any] | None = None  # with a request's first token, when it asked
    embedding: list[float] | None = None  # a pooling request's vector, with its finish


@dataclass(slots=True)
class Disconnected:
    """Redis went away. Not `final`: replies are delayed (engines hold them until it is back), so a running
    request waits, while one not accepted yet is answered 503 at once. `final`: the outage outlasted the
    grace, and replies may be lost."""

    message: str
    final: bool = True


Reply = Accepted | RequestError | Delta | Disconnected


class ResponseRouter:
    def __init__(self, redis: Any, gateway_id: str, outage_grace_s: float = 0.0) -> None:
        self.redis = redis
        self.outage_grace_s = outage_grace_s
        self.stream = streams.response_stream(gateway_id)
        self.queues: dict[str, asyncio.Queue[Reply]] = {}
        self.last_id = b"0-0"  # a gateway's stream is its own: read all of it, once
        self.last_trim = 0.0

    def register(self, request_id: str) -> asyncio.Queue[Reply]:
        queue: asyncio.Queue[Reply] = asyncio.Queue()
        self.queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def run(self) -> None:
        down_since: float | None = None
        has_given_up = False
        message = "lost the connection to the request queue (Redis); retry shortly"  # the detail is logged
        while True:
            try:
                reply = await self.redis.xread({self.stream: self.last_id}, block=1000, count=512)
                if down_since is not None:
                    log.info("redis is back after %.1f s; response stream resumed", time.monotonic() - down_since)
                    down_since, has_given_up = None, False
            except RedisTimeoutError:
                continue  # a slow reply loses nothing: the stream keeps the entries after last_id
            except (RedisConnectionError, OSError) as exc:
                if down_since is None:
                    log.warning("response stream lost: %s", exc)
                    down_since = time.monotonic()
                    self._fail_all(message, final=self.outage_grace_s <= 0)
                elif not has_given_up and time.monotonic() - down_since > self.outage_grace_s:
                    log.warning("redis is still away after %.0f s: ending the streams in flight", self.outage_grace_s)
                    has_given_up = True
                    self._fail_all(message, final=True)
                await asyncio.sleep(0.25)
                continue
            for _, items in reply or []:
                for entry_id, fields in items:
                    self.last_id = entry_id
                    self._dispatch(fields.get(streams.DATA_FIELD, b""))
            if reply and time.monotonic() - self.last_trim > _TRIM_INTERVAL_S:
                await self._trim()

    async def _trim(self) -> None:
        # Replies are read once, by this gateway alone: drop what has been read.
        self.last_trim = time.monotonic()
        with contextlib.suppress(RedisConnectionError, RedisTimeoutError, OSError):
            await self.redis.xtrim(self.stream, minid=self.last_id, approximate=True)

    def _dispatch(self, data: bytes) -> None:
        try:
            msg = decode(data)
        except DecodeError as exc:
            log.error("skipping an undecodable reply: %s", exc)
            return
        if isinstance(msg, TokenDeltas):
            for i, request_id in enumerate(msg.request_ids):
                queue = self.queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(
                        Delta(
                            msg.indexes[i],
                            msg.token_ids[i],
                            msg.logprobs[i],
                            msg.finish_reasons[i],
                            msg.num_prompt_tokens[i],
                            msg.num_output_tokens[i],
                            msg.num_cached_tokens[i],
                            msg.engine_id,
                            msg.prompt_logprobs[i] if i < len(msg.prompt_logprobs) else None,
                            msg.embeddings[i] if i < len(msg.embeddings) else None,
                        )
                    )
        elif isinstance(msg, Accepted | RequestError):
            queue = self.queues.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)
        else:
            log.error("unexpected %s on the response stream", type(msg).__name__)

    def _fail_all(self, message: str, final: bool) -> None:
        for queue in self.queues.values():
            queue.put_nowait(Disconnected(message, final))
