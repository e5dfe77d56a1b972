"""The tokenizer service: reads requests, renders and tokenizes prompts, forwards them to the engines.

For each request: Accepted (or RequestError) to the gateway first, then the GenerateRequest to the
model's engines, then XACK. Where several replicas serve the model, the prefix router
(prefix_router.py) sends a prompt whose prefix one replica already holds in its KV cache to that
replica's own stream; the rest go to the shared stream every replica pulls from.

A crash in between leaves the entry pending; another tokenizer claims it and redoes it, and the
duplicate is harmless (the gateway and the engines dedupe on request_id).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from opentelemetry import trace
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedserve.services.tokenizer.metrics import TokenizerMetrics
from pagedserve.services.tokenizer.prefix_router import PrefixRouter
from pagedserve.services.tokenizer.processor import PromptProcessor
from pagedserve.shared import streams, telemetry
from pagedserve.shared.config import Config
from pagedserve.shared.outage import OutageLog
from pagedserve.shared.protocol import (
    Accepted,
    ChatRequest,
    CompletionRequest,
    DecodeError,
    EngineHeartbeat,
    GenerateRequest,
    KVEvents,
    RequestError,
    TokenizerHeartbeat,
    decode_as,
    encode,
)
from pagedserve.shared.publisher import Publisher

log = logging.getLogger(__name__)
_MAX_BACKOFF_S = 0.5  # bounds how long after Redis returns the tokenizer takes requests again
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
            # a tokenizer whose heartbeat expired (killed) has its requests claimed at once, not after claim_idle_ms
            heartbeat_key=lambda consumer: streams.tokenizer_key(model, consumer),
        )
        self.publisher = Publisher(self.redis)
        self.router = PrefixRouter(
            max_queued=config.routing.prefix_max_queued,
            max_imbalance=config.routing.prefix_max_imbalance,
            min_hit_tokens=config.routing.prefix_min_hit_tokens,
        )
        self.is_prefix_routing = config.routing.routing_policy == "prefix"
        self.engines: list[EngineHeartbeat] = []  # the model's live replicas, as of the last heartbeat round
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
        watching = asyncio.create_task(self._read_kv_events()) if self.is_prefix_routing else None
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
        tasks = [t for t in (publishing, beating, watching) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(*_REDIS_ERRORS):  # gone at once, not after its TTL
            await self.redis.delete(streams.tokenizer_key(self.model, self.settings.consumer_name))
        await self.redis.aclose()

    async def _heartbeat(self) -> None:
        """Say this tokenizer is alive (gateways answer 503 at once for a model without one), and keep the
        context limit (the smallest any live engine serves) and the router's view of the replicas current."""
        key = streams.tokenizer_key(self.model, self.settings.consumer_name)
        ttl_ms = int(self.settings.tokenizer_heartbeat_ttl_s * 1000)
        while True:
            beat = TokenizerHeartbeat(self.settings.consumer_name, self.model, time.time())
            try:
                await self.redis.set(key, encode(beat), px=ttl_ms)
                self.engines = await live_engines(self.redis, self.model)
                self.processor.served_limit = context_limit(self.engines)
                self.router.forget_gone({e.engine_id for e in self.engines})
            except _REDIS_ERRORS as exc:  # the read loop reports the outage; keep the last limit
                log.debug("tokenizer heartbeat failed: %s", exc)
                await asyncio.sleep(0.2)  # registered again as soon as Redis is back
                continue
            await asyncio.sleep(self.settings.tokenizer_heartbeat_interval_s)

    async def _read_kv_events(self) -> None:
        """Keep the prefix index current: every replica's KV events, from the oldest the stream keeps (each
        replica also publishes a full snapshot now and then, so a router started late catches up)."""
        stream, last_id = streams.kv_events_stream(self.model), "0"
        while True:
            try:
                reply: Any = await self.redis.xread({stream: last_id}, block=1000, count=512)
            except _REDIS_ERRORS as exc:
                log.debug("reading KV events failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for _, items in reply or []:
                for entry_id, fields in items:
                    last_id = entry_id
                    try:
                        self.router.index.apply(decode_as(fields.get(streams.DATA_FIELD, b""), KVEvents))
                    except DecodeError as exc:
                        log.error("skipping a bad KV event %s: %s", entry_id, exc)

    def _route(self, generate: GenerateRequest, cache_key: str | None) -> str:
        """The stream this request goes to: a replica's own when it holds the prompt's prefix, else the
        shared one. The decision is on the request's span and in the metrics."""
        if not self.is_prefix_routing:
            return streams.generate_stream(self.model)
        salt = generate.sampling.get("cache_salt") if isinstance(generate.sampling, dict) else None
        decision = self.router.route(generate.prompt_token_ids, salt, self.engines, cache_key, generate.lora_name)
        span = trace.get_current_span()
        span.set_attribute("pagedserve.route.engine", decision.engine_id or "shared")
        span.set_attribute("pagedserve.route.reason", decision.reason)
        span.set_attribute("pagedserve.route.overlap_blocks", decision.overlap_blocks)
        if self.metrics is not None:
            self.metrics.routes.labels(self.model, decision.engine_id or "shared", decision.reason).inc()
            if decision.engine_id is not None and decision.prompt_blocks:
                self.metrics.route_overlap.observe(decision.overlap_blocks / decision.prompt_blocks)
        if decision.engine_id is None:
            return streams.generate_stream(self.model)
        return streams.engine_stream(self.model, decision.engine_id)

    async def _handle_all(self, entries: list[streams.Entry]) -> None:
        """Answer the entries concurrently, dropping what the gateway already gave up on (it was down, or slow,
        when the abort went out). That check is one round trip for the batch, made while the prompts are
        tokenized (each request waits for it only before it is published), not before: off the first token."""
        requests = [e.message.request_id for e in entries if isinstance(e.message, ChatRequest | CompletionRequest)]
        given_up = asyncio.ensure_future(streams.aborted_ids(self.redis, self.model, requests))
        try:
            handled = await asyncio.gather(*(self._handle(entry, given_up) for entry in entries))
        finally:
            if given_up.done() and not given_up.cancelled():
                given_up.exception()  # retrieved: a failed check was raised to the requests that awaited it
            given_up.cancel()  # done by now, unless a request failed first
        await self.reader.ack(*handled)  # one round trip for the batch, once every answer is in Redis

    async def _handle(self, entry: streams.Entry, given_up: asyncio.Future[set[str]]) -> bytes:
        """Answer one entry; returns its id, to acknowledge."""
        req = entry.message
        if not isinstance(req, ChatRequest | CompletionRequest):
            log.error("unexpected %s on the request stream; skipped", type(req).__name__)
            return entry.entry_id
        lag = telemetry.record_stream_wait(self.reader.stream, entry.entry_id, req.traceparent)
        operation = telemetry.genai_operation(req)
        attributes = telemetry.genai_request_attributes(operation, req.model, req.sampling, req.max_tokens)
        with telemetry.tracer(__name__).start_as_current_span(
            "tokenizer.process",
            context=telemetry.context_from(req.traceparent),
            attributes={**attributes, "pagedserve.request_id": req.request_id},
        ):
            started = time.perf_counter()
            outcome = await self._process(req, given_up)
        if outcome == "dropped":
            log.info("request %s was aborted before it was tokenized; dropped", req.request_id)
            return entry.entry_id
        if self.metrics is not None:
            self.metrics.queue_lag.observe(lag)
            self.metrics.duration.observe(time.perf_counter() - started)
            self.metrics.count(outcome)
        return entry.entry_id

    async def _process(self, req: ChatRequest | CompletionRequest, given_up: asyncio.Future[set[str]]) -> str:
        """Answer one request; returns the outcome ("accepted", "rejected" or "error") for the metrics, or
        "dropped" when the gateway gave up on it (`given_up`: those of the batch) and nothing was sent."""
        with telemetry.tracer(__name__).start_as_current_span("tokenizer.tokenize") as span:
            result = await self._tokenize(req)
            if not isinstance(result, RequestError):
                span.set_attribute("gen_ai.usage.input_tokens", result[0].num_prompt_tokens)
        if req.request_id in await asyncio.shield(given_up):
            return "dropped"
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
            self.publisher.send(self._route(generate, req.sampling.get("prompt_cache_key")), generate, maxlen),
        ]
        await asyncio.gather(*sent)
        return "accepted"

    async def _tokenize(self, req: ChatRequest | CompletionRequest) -> tuple[Accepted, GenerateRequest] | RequestError:
        try:
            if _is_token_ids(req):  # nothing to tokenize: a thread hop would cost more than the checks
                return self.processor.process(req)
            return await asyncio.to_thread(self.processor.process, req)
        except Exception:  # a bug, or a malformed message from a foreign producer: answer, keep serving
            log.exception("could not process request %s", req.request_id)
            return RequestError(
                req.request_id, 500, "internal error while preparing the prompt", type="internal_server_error"
            )


def _is_token_ids(req: ChatRequest | CompletionRequest) -> bool:
    return isinstance(req, CompletionRequest) and req.pooling is None and isinstance(req.prompt, list)


async def live_engines(redis: Any, model: str) -> list[EngineHeartbeat]:
    """The heartbeats of `model`'s engines that are up and not draining."""
    pattern = streams.engine_key(streams.glob_escape(model), "*")
    keys = [key async for key in redis.scan_iter(match=pattern, count=200)]
    beats = []
    for raw in await redis.mget(keys) if keys else []:
        if raw is None:  # expired between SCAN and MGET
            continue
        try:
            beat = decode_as(raw, EngineHeartbeat)
        except DecodeError as exc:
            log.error("skipping a bad engine heartbeat: %s", exc)
            continue
        if not beat.is_draining:
            beats.append(beat)
    return beats


def context_limit(engines: list[EngineHeartbeat]) -> int | None:
    """The smallest context limit among live engines (each publishes the one it serves: its
    --max-model-len, or less where its KV cache holds less), or None while none is up."""
    return min((e.max_model_len for e in engines), default=None)
