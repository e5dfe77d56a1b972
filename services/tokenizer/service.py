"""The tokenizer service: reads requests, renders and tokenizes prompts, forwards them to the engines.

For each request: Accepted (or RequestError) to the gateway first, then the GenerateRequest to the
model's engine stream, then XACK. A crash in between leaves the entry pending; another tokenizer
claims it and redoes it, and the duplicate is harmless (the gateway and the engines dedupe on
request_id).
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.tokenizer.processor import PromptProcessor
from shared import streams, telemetry
from shared.outage import OutageLog
from shared.protocol import ChatRequest, CompletionRequest, RequestError
from shared.publisher import Publisher
from shared.settings import TokenizerSettings

log = logging.getLogger(__name__)
_MAX_BACKOFF_S = 2.0  # bounds how long after Redis returns the tokenizer takes requests again


class TokenizerService:
    def __init__(self, settings: TokenizerSettings, model: str, processor: PromptProcessor) -> None:
        self.settings, self.model, self.processor = settings, model, processor
        self.redis = streams.connect(settings.redis_url)
        self.reader = streams.GroupReader(
            self.redis, streams.request_stream(model), streams.TOKENIZER_GROUP, settings.consumer_name,
            claim_idle_ms=settings.claim_idle_ms,
        )
        self.publisher = Publisher(self.redis)
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        backoff = 0.1
        outage = OutageLog(log)
        log.info("tokenizer %s serving model %s", self.settings.consumer_name, self.model)
        publishing = asyncio.create_task(self.publisher.run())
        while not self._stopping.is_set():
            try:
                await self.reader.ensure_group()
                while not self._stopping.is_set():
                    entries = await self.reader.read(count=32, block_ms=500)
                    await asyncio.gather(*(self._handle(entry) for entry in entries))
                    stale = await self.reader.claim_stale_if_due()
                    await asyncio.gather(*(self._handle(entry) for entry in stale))
                    outage.recovered()
                    backoff = 0.1
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                outage.failed("reading requests", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
        await self.redis.aclose()

    async def _handle(self, entry: streams.Entry) -> None:
        req = entry.message
        if not isinstance(req, ChatRequest | CompletionRequest):
            log.error("unexpected %s on the request stream; skipped", type(req).__name__)
            await self.reader.ack(entry.entry_id)
            return
        with telemetry.tracer(__name__).start_as_current_span(
            "tokenizer.process", context=telemetry.context_from(req.traceparent),
            attributes={"pagedserve.request_id": req.request_id},
        ):
            await self._process(req)
        await self.reader.ack(entry.entry_id)

    async def _process(self, req: ChatRequest | CompletionRequest) -> None:
        try:
            result = await asyncio.to_thread(self.processor.process, req)
        except Exception:  # a bug, or a malformed message from a foreign producer: answer, keep serving
            log.exception("could not process request %s", req.request_id)
            result = RequestError(req.request_id, 500, "internal error while preparing the prompt",
                                  type="internal_server_error")
        reply_stream = streams.response_stream(req.reply_to)
        if isinstance(result, RequestError):
            await self.publisher.publish(reply_stream, result, self.settings.stream_maxlen)
        else:
            accepted, generate = result
            generate.traceparent = telemetry.current_traceparent()  # the engine's span: a child of this one
            # Accepted goes first, in the same pipelined batch as the work itself: one round trip.
            maxlen = self.settings.stream_maxlen
            sent = [self.publisher.send(reply_stream, accepted, maxlen),
                    self.publisher.send(streams.generate_stream(self.model), generate, maxlen)]
            await asyncio.gather(*sent)
