"""The tokenizer service: reads requests, renders and tokenizes prompts, forwards them to the engines.

For each request: Accepted (or RequestError) to the gateway first, then the GenerateRequest to the
model's engine stream, then XACK. A crash in between leaves the entry pending; another tokenizer
claims it and redoes it, and the duplicate is harmless (the gateway and the engines dedupe on
request_id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedserve.services.tokenizer.metrics import TokenizerMetrics
from pagedserve.services.tokenizer.processor import PromptProcessor
from pagedserve.shared import streams, telemetry
from pagedserve.shared.config import Config
from pagedserve.shared.outage import OutageLog
from pagedserve.shared.protocol import (
    Accepted,
    ChatRequest,
    CompletionRequest,
    EngineHeartbeat,
    GenerateRequest,
    RequestError,
    TokenizerHeartbeat,
    decode_as,
    encode,
)
from pagedserve.shared.publisher import Publisher

log = logging.getLogger(__name__)
_MAX_BACKOFF_S = 2.0  # bounds how long after Redis returns the tokenizer takes requests again
_REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class TokenizerService:
    def __init__(
        self, config: Config, model: str, processor: PromptProcessor, metrics: TokenizerMetrics | None = None
    ) -> None:
        self.settings = settings = config.tokenizer
        self.routing = config.routing
        self.model, self.processor = model, processor
        self.metrics = metrics
        self.redis = streams.connect(config.routing.url)
        self.reader = streams.GroupReader(
            self.redis,
            streams.request_stream(model),
            streams.TOKENIZER_GROUP,
            settings.consumer_name,
            claim_idle_ms=settings.claim_idle_ms,
        )
        self.publisher = Publisher(self.redis)
        self._stopping = asyncio.Event()
        self.redis_ok = False  # the last read reached Redis

    def is_ready(self) -> bool:
        return self.redis_ok and not self._stopping.is_set()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        backoff = 0.1
        outage = OutageLog(log)
        log.info("tokenizer %s serving model %s", self.settings.consumer_name, self.model)
        publishing = asyncio.create_task(self.publisher.run())
        beating = asyncio.create_task(self._heartbeat())
        while not self._stopping.is_set():
            try:
                await self.reader.ensure_group()
                while not self._stopping.is_set():
                    entries = await self.reader.read(count=128, block_ms=500)  # a burst in few round trips
                    await self._handle_all(entries)
                    await self._handle_all(await self.reader.claim_stale_if_due())
                    outage.recovered()
                    self.redis_ok = True
                    backoff = 0.1
            except _REDIS_ERRORS as exc:
                self.redis_ok = False
                outage.failed("reading requests", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
        for task in (publishing, beating):
            task.cancel()
        await asyncio.gather(publishing, beating, return_exceptions=True)
        with contextlib.suppress(*_REDIS_ERRORS):  # gone at once, not after its TTL
            await self.redis.delete(streams.tokenizer_key(self.model, self.settings.consumer_name))
        await self.redis.aclose()

    async def _heartbeat(self) -> None:
        """Say this tokenizer is alive (gateways answer 503 at once for a model without one), and keep the
        context limit in step with the model's live engines: the smallest any of them serves."""
        key = streams.tokenizer_key(self.model, self.settings.consumer_name)
        ttl_ms = int(self.settings.tokenizer_heartbeat_ttl_s * 1000)
        while True:
            beat = TokenizerHeartbeat(self.settings.consumer_name, self.model, time.time())
            try:
                await self.redis.set(key, encode(beat), px=ttl_ms)
                self.processor.served_limit = await engine_context_limit(self.redis, self.model)
            except _REDIS_ERRORS as exc:  # the read loop reports the outage; keep the last limit
                log.debug("tokenizer heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.tokenizer_heartbeat_interval_s)

    async def _handle_all(self, entries: list[streams.Entry]) -> None:
        """Drop what the gateway already gave up on (it was down, or slow, when the abort went out), then
        answer the rest concurrently."""
        requests = [e.message.request_id for e in entries if isinstance(e.message, ChatRequest | CompletionRequest)]
        given_up = await streams.aborted_ids(self.redis, self.model, requests)
        for entry in entries:
            if isinstance(entry.message, ChatRequest | CompletionRequest) and entry.message.request_id in given_up:
                log.info("request %s was aborted before it was tokenized; dropped", entry.message.request_id)
                await self.reader.ack(entry.entry_id)
        await asyncio.gather(
            *(self._handle(entry) for entry in entries if getattr(entry.message, "request_id", None) not in given_up)
        )

    async def _handle(self, entry: streams.Entry) -> None:
        req = entry.message
        if not isinstance(req, ChatRequest | CompletionRequest):
            log.error("unexpected %s on the request stream; skipped", type(req).__name__)
            await self.reader.ack(entry.entry_id)
            return
        lag = telemetry.record_stream_wait(self.reader.stream, entry.entry_id, req.traceparent)
        operation = "chat" if isinstance(req, ChatRequest) else "text_completion"
        attributes = telemetry.genai_request_attributes(operation, req.model, req.sampling, req.max_tokens)
        with telemetry.tracer(__name__).start_as_current_span(
            "tokenizer.process",
            context=telemetry.context_from(req.traceparent),
            attributes={**attributes, "pagedserve.request_id": req.request_id},
        ):
            started = time.perf_counter()
            outcome = await self._process(req)
        if self.metrics is not None:
            self.metrics.queue_lag.observe(lag)
            self.metrics.duration.observe(time.perf_counter() - started)
            self.metrics.count(outcome)
        await self.reader.ack(entry.entry_id)

    async def _process(self, req: ChatRequest | CompletionRequest) -> str:
        """Answer one request; returns the outcome ("accepted", "rejected" or "error") for the metrics."""
        with telemetry.tracer(__name__).start_as_current_span("tokenizer.tokenize") as span:
            result = await self._tokenize(req)
            if not isinstance(result, RequestError):
                span.set_attribute("gen_ai.usage.input_tokens", result[0].num_prompt_tokens)
        reply_stream = streams.response_stream(req.reply_to)
        maxlen = self.routing.stream_maxlen
        if isinstance(result, RequestError):
            await self.publisher.publish(reply_stream, result, maxlen)
            return "error" if result.status >= 500 else "rejected"
        accepted, generate = result
        generate.traceparent = telemetry.current_traceparent()  # the engine's span: a child of this one
        # Accepted goes first, in the same pipelined batch as the work itself: one round trip.
        sent = [
            self.publisher.send(reply_stream, accepted, maxlen),
            self.publisher.send(streams.generate_stream(self.model), generate, maxlen),
        ]
        await asyncio.gather(*sent)
        return "accepted"

    async def _tokenize(self, req: ChatRequest | CompletionRequest) -> tuple[Accepted, GenerateRequest] | RequestError:
        try:
            return await asyncio.to_thread(self.processor.process, req)
        except Exception:  # a bug, or a malformed message from a foreign producer: answer, keep serving
            log.exception("could not process request %s", req.request_id)
            return RequestError(
                req.request_id, 500, "internal error while preparing the prompt", type="internal_server_error"
            )


async def engine_context_limit(redis: Any, model: str) -> int | None:
    """The smallest context limit among `model`'s live engines (each publishes the one it serves: its
    --max-model-len, or less where its KV cache holds less), or None while none is up."""
    pattern = streams.engine_key(_glob_escape(model), "*")
    keys = [key async for key in redis.scan_iter(match=pattern, count=200)]
    limits = []
    for raw in await redis.mget(keys) if keys else []:
        if raw is not None:
            beat = decode_as(raw, EngineHeartbeat)
            if not beat.is_draining:
                limits.append(beat.max_model_len)
    return min(limits, default=None)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
