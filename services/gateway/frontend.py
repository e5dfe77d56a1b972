"""The gateway's side of a request's life: submit, wait for Accepted, turn deltas into choice text.

    submit()  ──XADD ps:{model}:req──►  tokenizer  ──Accepted | RequestError──►  router queue
    Generation.updates()  ◄── Delta per engine step ◄── router queue
    (finally) Abort ──XADD ps:{model}:ctl──► engines, unless every choice finished

If the engine serving a request stops heartbeating, the request moves to a live replica as a
continuation (prompt + tokens already streamed, per choice for n > 1, where finished choices stay
finished; under a new internal id; the old id is aborted so a replica that later claims the stale
entry drops it): the client stream goes on with no lost or repeated tokens. With no live replica
the stream ends with an error instead of hanging.

Whatever ends a request (finish, error, client gone, migration then any of these, drain, queue wait),
Frontend.release is its one end: slot, router queues under every id it had, span and abort, once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedserve.services.gateway.detokenizer import ChoiceText, TextOptions
from pagedserve.services.gateway.errors import APIError, model_not_found, model_unavailable
from pagedserve.services.gateway.metrics import GatewayMetrics, observe_generation, observe_tokens, observe_ttft
from pagedserve.services.gateway.registry import ModelEntry, ModelRegistry
from pagedserve.services.gateway.router import Delta, Disconnected, ResponseRouter
from pagedserve.services.gateway.token_text import TokenTexts
from pagedserve.services.gateway.tokenizers import TokenizerCache
from pagedserve.services.gateway.worker_readiness import WorkerReadiness
from pagedserve.shared import streams, telemetry
from pagedserve.shared.config import Config
from pagedserve.shared.outage import OutageLog
from pagedserve.shared.protocol import (
    Abort,
    Accepted,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    RequestError,
    Sampling,
)
from pagedserve.shared.publisher import Publisher

log = logging.getLogger(__name__)
_REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
_WATCH_INTERVAL_S = 1.0  # how often a waiting request checks that its engine is still alive
_MAX_MIGRATIONS = 3
_READY_PUBLISH_S = 0.25  # how often a gateway worker tells the others whether it is ready
_ABORT_WAIT_S = 1.0  # how long a request that failed before acceptance waits for its abort to be recorded


async def _next_reply(queue: asyncio.Queue[Any], timeout: float) -> Any:
    """The queue's next reply, TimeoutError after `timeout` s. The per-token hot path: a reply already queued
    costs no timer, and a wait costs one timer handle (asyncio.wait_for makes a task per call)."""
    if not queue.empty():
        return queue.get_nowait()
    async with asyncio.timeout(timeout):
        return await queue.get()


@dataclass(slots=True)
class ChoiceUpdate:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Any] | None  # per token [logprob, [[token_id, logprob], ...]]
    finish_reason: str | None

    def extended(self, later: ChoiceUpdate) -> ChoiceUpdate:
        """This update followed by a later one of the same choice, as one."""
        logprobs = (
            None
            if self.logprobs is None and later.logprobs is None
            else [*(self.logprobs or []), *(later.logprobs or [])]
        )
        return ChoiceUpdate(
            self.index,
            self.text + later.text,
            self.token_ids + later.token_ids,
            logprobs,
            later.finish_reason or self.finish_reason,
        )


@dataclass(slots=True)
class Generation:
    frontend: Frontend
    request_id: str
    model: str
    accepted: Accepted
    queue: asyncio.Queue[Any]
    choices: list[ChoiceText]
    token_texts: TokenTexts
    sampling: Sampling = field(default_factory=lambda: Sampling())
    created: int = field(default_factory=lambda: int(time.time()))
    num_cached_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)
    engine_finished: set[int] = field(default_factory=set)  # choices the engine itself ended
    engine_id: str | None = None  # the replica producing the tokens, once one has sent any
    current_id: str = ""  # the id the engines know: request_id, or its continuation's id
    ids: list[str] = field(default_factory=list)  # every id it has had: each has a router queue until released
    released: bool = False  # its gateway state was freed (Frontend.release): the one end of the request
    num_migrations: int = 0
    started: float = field(default_factory=time.monotonic)
    has_first_token: bool = False
    last_token_at: float = 0.0  # for the inter-token latency
    span: Span | None = None  # the request's trace span, ended when the generation ends
    response_id: str = ""  # the id clients see, when the request named one (vLLM's request_id); else request_id
    prompt_logprobs: list[Any] | None = None  # per prompt token (None first), when the request asked
    num_output_tokens: dict[int, int] = field(default_factory=dict)  # per choice: the engine's count so far
    saw_outage: bool = False  # a Redis outage began while it ran
    has_gap: bool = False  # tokens were lost in that outage: it must continue elsewhere
    pooling: dict[str, Any] | None = None  # an embedding request's options (protocol.CompletionRequest.pooling)
    embedding: list[float] | None = None  # ... and its vector, once the engine sent it
    lora_name: str | None = None  # the LoRA adapter the request named (its `model`; `model` is the base)

    def __post_init__(self) -> None:
        self.current_id = self.current_id or self.request_id
        self.ids = self.ids or [self.current_id]

    @property
    def served_model(self) -> str:
        """The `model` of the responses: what the request named (an adapter, or the model)."""
        return self.lora_name or self.model

    @property
    def is_finished(self) -> bool:
        return len(self.finish_reasons) == len(self.choices)

    def usage(self) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for c in self.choices)
        prompt = self.accepted.num_prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }

    async def updates(self) -> AsyncGenerator[ChoiceUpdate]:
        """Choice updates until every choice finished; raises APIError if the request cannot go on."""
        settings = self.frontend.settings
        deadline = time.monotonic() + settings.request_timeout_s
        try:
            silent_since = time.monotonic()
            while not self.is_finished:
                timeout = min(_WATCH_INTERVAL_S, deadline - time.monotonic())
                if timeout <= 0:
                    raise APIError(408, "the request timed out", code="timeout")
                self._check_queue_wait()
                if self.has_gap and self.frontend.registry.is_settled():
                    self.has_gap = self.saw_outage = False
                    await self._migrate("tokens were lost in a Redis outage", quiet=True)
                try:
                    reply = await _next_reply(self.queue, timeout)
                except TimeoutError:
                    if self._is_engine_lost():
                        await self._migrate(f"engine {self.engine_id} is gone")
                        silent_since = time.monotonic()
                    elif self._was_lost_queued() and self.frontend.registry.is_settled():
                        self.saw_outage = False
                        await self._migrate("it was queued in a Redis that restarted", quiet=True)
                        silent_since = time.monotonic()
                    elif time.monotonic() - silent_since > settings.engine_silence_timeout_s:
                        entry = self.frontend.registry.get(self.model)
                        if self.frontend.registry.is_settled() and (entry is None or not entry.is_live):
                            raise model_unavailable(self.model) from None
                        silent_since = time.monotonic()  # engines are alive but busy: keep waiting
                    continue
                silent_since = time.monotonic()
                merged: dict[int, ChoiceUpdate] = {}
                error: APIError | None = None
                try:
                    self._apply_ready(reply, merged)
                except APIError as exc:
                    error = exc  # what came before it still goes out
                for update in merged.values():
                    yield update
                if error is not None:
                    raise error
                if not merged and self._is_engine_lost():
                    # Only another replica's tokens came: it claimed the lost engine's entry and runs it from
                    # scratch (dropped above). They must not hide the loss until that run ends.
                    await self._migrate(f"engine {self.engine_id} is gone")
        finally:
            self.frontend.release(self)

    def _check_queue_wait(self) -> None:
        """Overload: a request that waited too long for its first token is told to retry (and aborted by
        release) rather than left queued until the client or a proxy gives up."""
        waited = time.monotonic() - self.started
        if not self.has_first_token and waited > self.frontend.settings.max_queue_wait_s:
            log.info("%s had no first token after %.0f s in the queue; ending it with 429", self.request_id, waited)
            raise APIError(
                429,
                "the server is overloaded: the request waited too long for an engine; retry later",
                code="queue_wait_exceeded",
                retry_after=5,
            )

    def _apply_ready(self, reply: Any, merged: dict[int, ChoiceUpdate]) -> None:
        """Apply `reply` and every reply already queued behind it, one merged update per choice: a
        client that fell behind gets one chunk (one write) for all it missed, not one per step."""
        while True:
            update = self._apply(reply)
            if update is not None:
                previous = merged.get(update.index)
                merged[update.index] = update if previous is None else previous.extended(update)
            if self.is_finished or self.queue.empty():
                return
            reply = self.queue.get_nowait()

    def _apply(self, reply: Any) -> ChoiceUpdate | None:
        if isinstance(reply, Disconnected):
            if not reply.final:
                self.saw_outage = True
                return None  # the engines hold this request's tokens until Redis is back
            raise APIError(503, reply.message, retry_after=2)
        if isinstance(reply, RequestError):
            raise APIError(reply.status, reply.message, param=reply.param, code=reply.code, type=reply.type)
        if not isinstance(reply, Delta) or reply.index in self.finish_reasons:
            return None  # a duplicate Accepted, or tokens after a stop string ended the choice
        if self.engine_id is not None and reply.engine_id != self.engine_id:
            # another replica claimed the entry of the one streaming it (its heartbeat expired) and runs it
            # from scratch: drop that; the request moves as a continuation once that engine is gone
            return None
        if self.has_gap:
            return None  # it continues from what the client has, elsewhere
        seen = self.num_output_tokens.get(reply.index, 0)
        if reply.token_ids and self.saw_outage and reply.num_output_tokens <= seen:
            return None  # sent again: an engine re-sends what it buffered through a Redis outage
        if reply.token_ids and self.saw_outage and reply.num_output_tokens - len(reply.token_ids) > seen:
            # tokens Redis took just before it went down never reached us: continue from what the client
            # has, as after an engine loss, rather than stream on with a hole (the outage is logged once)
            self.has_gap = True
            return None
        if reply.token_ids:
            self.num_output_tokens[reply.index] = reply.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, reply.num_cached_tokens)
        self.engine_id = reply.engine_id
        now = time.monotonic()
        if self.has_first_token and reply.token_ids and len(self.choices) == 1:
            observe_tokens(self.frontend.metrics, self.model, len(reply.token_ids), now - self.last_token_at)
        if reply.token_ids:
            self.last_token_at = now
        if reply.prompt_logprobs is not None:
            self.prompt_logprobs = reply.prompt_logprobs
        if reply.embedding is not None:
            self.embedding = reply.embedding
        if not self.has_first_token and reply.token_ids:
            self.has_first_token = True
            if self.span is not None:
                self.span.add_event("gen_ai.first_token")
            observe_ttft(self.frontend.metrics, self.model, time.monotonic() - self.started)
        if reply.finish_reason is not None:
            self.engine_finished.add(reply.index)
        choice = self.choices[reply.index]
        token_ids = reply.token_ids
        # The engine ends a choice with "stop" on an EOS/stop token: count it, never show it.
        shown = token_ids[:-1] if reply.finish_reason == "stop" and token_ids else token_ids
        text = choice.add(shown, is_last=reply.finish_reason is not None)
        if reply.finish_reason == "stop" and token_ids:
            choice.token_ids.append(token_ids[-1])
            if token_ids[-1] in (self.sampling.get("stop_token_ids") or ()):  # not EOS: vLLM names it
                choice.stop_token_id = token_ids[-1]
        finish = text.finish_reason or reply.finish_reason
        if finish is not None:
            self.finish_reasons[reply.index] = finish
        if reply.finish_reason is None and text.finish_reason is not None and not self.is_finished:
            self.frontend.abort_choice(self, reply.index)  # a stop string ended one choice of several
        return ChoiceUpdate(reply.index, text.text, token_ids, reply.logprobs, finish)

    def _was_lost_queued(self) -> bool:
        """Redis went away (and came back empty, for all we know) before any engine sent a token: a request
        still queued in a stream went with it, and one an engine had taken would have sent its tokens
        by now (engines re-send what they held once Redis is back), so it is submitted again."""
        return self.saw_outage and self.engine_id is None and not self.has_first_token

    def _is_engine_lost(self) -> bool:
        registry = self.frontend.registry
        entry = registry.get(self.model)
        if self.engine_id is None or not registry.is_settled() or entry is None:
            # not started yet (a dead reader's entry is claimed by another), or Redis is down or has just
            # come back (the engines' records reappear within a heartbeat)
            return False
        return all(e.engine_id != self.engine_id for e in entry.engines)

    async def _migrate(self, why: str, quiet: bool = False) -> None:
        """Resubmit to a live replica as a continuation, or end the request if that is impossible. `quiet`:
        log at INFO (after a Redis outage, which is warned of once), not a warning per request."""
        entry = self.frontend.registry.get(self.model)
        can_continue = len(self.choices) == 1 or (  # an older engine would restart every choice from scratch
            entry is not None and all(e.supports_choice_continuation for e in entry.engines)
        )
        if not can_continue or self.num_migrations >= _MAX_MIGRATIONS or entry is None or not entry.is_live:
            raise APIError(
                503, f"the engine serving this request ({self.engine_id}) stopped", retry_after=2, code="engine_lost"
            )
        self.num_migrations += 1
        old_id, self.current_id = self.current_id, f"{self.request_id}.r{self.num_migrations}"
        log.log(
            logging.INFO if quiet else logging.WARNING, "%s; %s continues as %s", why, self.request_id, self.current_id
        )
        self.engine_id = None
        await self.frontend.move(self, old_id)


class Frontend:
    def __init__(self, config: Config, workers: WorkerReadiness | None = None) -> None:
        self.settings = settings = config.gateway
        self.workers = workers  # with --workers N: every worker's readiness (worker_readiness.py)
        self.routing = config.routing
        self.redis = streams.connect(config.routing.url, settings.redis_max_connections)
        self.publisher = Publisher(self.redis)  # every XADD of every request, pipelined
        self.router = ResponseRouter(self.redis, settings.gateway_id, config.routing.redis_outage_grace_s)
        self.registry = ModelRegistry(self.redis, settings.registry_refresh_s)
        self.num_in_flight = 0
        self.is_draining = False
        self.tokenizers = TokenizerCache(config.model)
        self.outage = OutageLog(log)  # aborts that cannot be sent: one warning per outage, not one per request
        self.metrics: GatewayMetrics | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._readers: list[asyncio.Task[None]] = []  # the router and the registry, of _tasks

    async def start(self) -> None:
        # Long-running: the reply reader, the registry and the publisher (which spawned aborts still need).
        self._readers = [asyncio.create_task(task.run()) for task in (self.router, self.registry, self.publisher)]
        try:
            await self.registry.refresh()
        except _REDIS_ERRORS as exc:
            log.warning("redis not reachable at start: %s", exc)
        self._readers.append(asyncio.create_task(self._warm_tokenizers()))
        self._readers.append(asyncio.create_task(self._beat()))
        self._tasks = list(self._readers)

    async def _beat(self) -> None:
        """Keep this process's record (streams.gateway_key) alive: once it is gone (the process was killed)
        or names another process (a worker that replaced this one), engines stop its requests."""
        key, process = streams.gateway_key(self.settings.gateway_id), uuid.uuid4().hex
        while True:
            try:
                await self.redis.set(key, process, px=int(streams.GATEWAY_TTL_S * 1000))
            except Exception as exc:  # any: a beat that stops for good would get every request stopped
                log.debug("gateway record not refreshed: %s", exc)  # the router and the requests report outages
            await asyncio.sleep(streams.GATEWAY_BEAT_S)

    async def _warm_tokenizers(self) -> None:
        """Load each model's tokenizer as soon as the model has a live engine, not on its first request:
        a worker that loads it then (seconds) would stall every request that reached it meanwhile."""
        while True:
            for entry in self.registry.live_models():
                if not self.tokenizers.is_loading(entry.name) and not self.tokenizers.has(entry.name):
                    self._spawn(self._warm_tokenizer(entry.name, entry.model_source))
            if self.workers is not None:  # the other workers' /ready reads it even if no probe reaches this one
                self.workers.publish(self.is_ready())
            await asyncio.sleep(min(self.settings.registry_refresh_s, _READY_PUBLISH_S))

    async def _warm_tokenizer(self, model: str, source: str | None) -> None:
        try:
            await self.tokenizers.get(model, source)
        except Exception as exc:  # the first request for the model retries and reports it
            log.warning("could not load the tokenizer of %s: %s", model, exc)
        if self.workers is not None:
            self.workers.publish(self.is_ready())

    def is_ready_everywhere(self) -> bool:
        """This worker is ready, and so is every other worker of the gateway (one process: this one)."""
        is_ready = self.is_ready()
        if self.workers is None:
            return is_ready
        self.workers.publish(is_ready)
        return is_ready and self.workers.all_ready()

    def is_ready(self) -> bool:
        """Redis is up, the gateway is not draining, and it can serve a live model without first loading
        that model's tokenizer, with a tokenizer service running for it."""
        live = self.registry.live_models()
        return (
            self.registry.is_redis_up
            and not self.is_draining
            and bool(live)
            and all(self.tokenizers.has(m.name) and m.tokenizers for m in live)
        )

    async def stop(self) -> None:
        spawned = [t for t in self._tasks if t not in self._readers]  # aborts on their way to the engines
        if spawned:
            await asyncio.wait(spawned, timeout=2.0)
        for task in self._tasks:
            task.cancel()
        # Bounded: a task that does not end on cancel (or a Redis close that hangs) must not keep the worker
        # from exiting; the supervisor kills a worker that outlives its stop grace (seen once in CI).
        if self._tasks:
            _, stuck = await asyncio.wait(list(self._tasks), timeout=_STOP_TIMEOUT_S)
            if stuck:
                log.warning("gateway stop: %d tasks still running after cancel: %s", len(stuck), _names(stuck))
        try:
            await asyncio.wait_for(self.redis.aclose(), _STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning("gateway stop: closing Redis took over %.0f s; leaving it", _STOP_TIMEOUT_S)

    async def tokenizer_for(self, model: str, source: str | None) -> Any:
        return (await self.tokenizers.get(model, source))[0]

    async def tokenizer_of(self, model: str) -> tuple[Any, int]:
        """A served model's tokenizer and context length, for /tokenize and /detokenize (a LoRA adapter's: its
        base model's)."""
        entry = self.registry.get(model)
        if entry is None and (base := self.registry.base_of(model)) is not None:
            entry, model = base, base.name
        if entry is None:
            raise model_not_found(model)
        if not self.tokenizers.has(model) and not entry.is_live:  # its source is known from live engines
            raise model_unavailable(model)
        return await self.tokenizer_for(model, entry.model_source), entry.max_model_len

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def submit(
        self, req: ChatRequest | CompletionRequest, stop: list[str], n: int, text: TextOptions | None = None
    ) -> Generation:
        """Send the request on its way and wait for the tokenizer's verdict, inside the request's span."""
        span = telemetry.tracer(__name__).start_span(
            "gateway.generate",
            context=telemetry.context_from(req.traceparent),
            attributes={
                "pagedserve.request_id": req.request_id,
                "pagedserve.model": req.model,
                **telemetry.genai_request_attributes(
                    telemetry.genai_operation(req),
                    req.model,
                    req.sampling,
                    req.max_tokens,
                ),
            },
        )
        req.traceparent = telemetry.traceparent_of(span)  # tokenizer and engine spans become its children
        try:
            gen = await self._submit(req, stop, n, text or TextOptions())
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            span.end()
            raise
        gen.span = span
        return gen

    async def _submit(
        self, req: ChatRequest | CompletionRequest, stop: list[str], n: int, text: TextOptions
    ) -> Generation:
        if self.is_draining:
            raise APIError(503, "the server is shutting down", retry_after=1)
        entry, lora_name = await self.registry.resolve(req.model)  # fresh: listed by another worker a moment ago
        if entry is None:
            raise model_not_found(req.model)
        check_runner(entry, req)
        if lora_name is not None:  # from here on the request is its base model's, run with the adapter
            req.model, req.lora_name = entry.name, lora_name
        # Just after a Redis outage the services' records come back within a heartbeat: a model served
        # before it is taken (its request waits in the stream), not refused for that second.
        if not entry.is_live and self.registry.is_settled():
            raise model_unavailable(req.model)
        if not entry.tokenizers and self.registry.is_settled():  # nobody would answer: say so now, not in 30 s
            raise APIError(
                503,
                f"no tokenizer service is running for model {req.model!r}; start one "
                f"(pagedserve tokenizer --model ...) or retry shortly",
                retry_after=2,
                code="tokenizer_unavailable",
            )
        if self.num_in_flight >= self.settings.max_in_flight:
            raise APIError(429, "too many requests in flight; retry shortly", retry_after=1)
        self.num_in_flight += 1  # before any await: the cap holds however many requests arrive at once
        queue = self.router.register(req.request_id)
        try:
            tokenizer, token_texts = await self.tokenizers.get(req.model, entry.model_source)
            await self.publisher.publish(streams.request_stream(req.model), req, self.routing.stream_maxlen)
            reply = await asyncio.wait_for(self._first_reply(queue), self.settings.accept_timeout_s)
        except TimeoutError:  # first: the builtin TimeoutError is an OSError, one of _REDIS_ERRORS
            # The abort is recorded before the client hears of the failure: a tokenizer that resumes just after
            # must find it, or the request would run for a client that was told it failed.
            self._forget(req.request_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.abort(req.model, req.request_id)), _ABORT_WAIT_S)
            raise APIError(503, "no tokenizer answered in time; retry shortly", retry_after=2) from None
        except _REDIS_ERRORS as exc:
            self.outage.failed(f"submitting {req.request_id}", exc)  # the detail goes to the log, not the client
            self._give_up(req.model, req.request_id)
            raise APIError(503, "the request queue (Redis) is unavailable; retry shortly", retry_after=2) from None
        except BaseException:  # the client left (cancelled) before acceptance, or a bug
            self._give_up(req.model, req.request_id)
            raise
        if isinstance(reply, RequestError):
            self._forget(req.request_id)
            raise APIError(reply.status, reply.message, param=reply.param, code=reply.code, type=reply.type)
        choices = [
            ChoiceText(
                tokenizer,
                reply.prompt_token_ids,
                stop,
                include_stop_str=text.include_stop_str,
                skip_special_tokens=text.skip_special_tokens,
            )
            for _ in range(n)
        ]
        gen = Generation(self, req.request_id, req.model, reply, queue, choices, token_texts, req.sampling)
        gen.pooling = req.pooling if isinstance(req, CompletionRequest) else None
        gen.lora_name = req.lora_name
        return gen

    async def _first_reply(self, queue: asyncio.Queue[Any]) -> Accepted | RequestError:
        while True:
            reply = await queue.get()
            if isinstance(reply, Disconnected):
                raise RedisConnectionError(reply.message)
            if isinstance(reply, Accepted | RequestError):
                return reply

    def _give_up(self, model: str, request_id: str) -> None:
        """A request that never became a Generation: free its slot and abort it, since a tokenizer or an
        engine may still hold (or later take) the submitted request."""
        self._forget(request_id)
        self._spawn(self.abort(model, request_id))

    def release(self, gen: Generation) -> None:
        """The one end of an accepted request, whatever ended it (finish, error, client gone, migration
        then any of these, drain): free its slot and its router queues under every id it had, end its
        span, abort unfinished work. Safe to call again: only the first call does anything."""
        if gen.released:
            return
        gen.released = True
        self.num_in_flight -= 1
        for request_id in gen.ids:
            self.router.unregister(request_id)
        usage = gen.usage()
        observe_generation(self.metrics, gen.model, usage, time.monotonic() - gen.started)
        if gen.span is not None:
            gen.span.set_attributes(
                {
                    "pagedserve.completion_tokens": usage["completion_tokens"],
                    "pagedserve.finish_reasons": [gen.finish_reasons.get(i, "none") for i in range(len(gen.choices))],
                    "pagedserve.migrations": gen.num_migrations,
                    "gen_ai.response.id": gen.request_id,
                    "gen_ai.response.finish_reasons": [
                        gen.finish_reasons.get(i, "none") for i in range(len(gen.choices))
                    ],
                    **telemetry.genai_usage_attributes(usage["prompt_tokens"], usage["completion_tokens"]),
                }
            )
            gen.span.end()
        if len(gen.engine_finished) < len(gen.choices):  # a stop string, a disconnect or an error
            self._spawn(self.abort(gen.model, gen.current_id))

    def abort_choice(self, gen: Generation, index: int) -> None:
        """End one choice of a request whose other choices go on, where every engine can do that."""
        entry = self.registry.get(gen.model)
        if entry is not None and entry.engines and all(e.supports_choice_abort for e in entry.engines):
            self._spawn(self.abort(gen.model, gen.current_id, [index]))

    async def move(self, gen: Generation, old_id: str) -> None:
        """Continue `gen` under its new id on whichever live replica takes it."""
        self.router.unregister(old_id)  # late tokens of the dead engine must not reach the client
        self.router.queues[gen.current_id] = gen.queue
        gen.ids.append(gen.current_id)  # release() unregisters it, whenever the request ends
        request = GenerateRequest(
            request_id=gen.current_id,
            reply_to=self.settings.gateway_id,
            model=gen.model,
            prompt_token_ids=gen.accepted.prompt_token_ids,
            sampling={**gen.sampling, "max_tokens": gen.accepted.max_tokens},
            arrival_time=time.time(),
            pooling=gen.pooling,
            lora_name=gen.lora_name,
        )
        if len(gen.choices) == 1:
            request.output_token_ids = list(gen.choices[0].token_ids)
        else:  # only the choices still running, under their own indexes
            request.choice_indexes = [i for i in range(len(gen.choices)) if i not in gen.finish_reasons]
            request.choice_output_token_ids = [list(gen.choices[i].token_ids) for i in request.choice_indexes]
        try:
            await self.abort(gen.model, old_id)
            await self.publisher.publish(streams.generate_stream(gen.model), request, self.routing.stream_maxlen)
        except _REDIS_ERRORS as exc:
            self.outage.failed(f"moving {gen.request_id} to another engine", exc)
            raise APIError(
                503,
                "could not move the request to another engine: the request queue (Redis) is unavailable; retry shortly",
                retry_after=2,
            ) from None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)  # a strong reference until it is done
        task.add_done_callback(self._tasks.remove)

    def _forget(self, request_id: str) -> None:
        self.router.unregister(request_id)
        self.num_in_flight -= 1

    async def abort(self, model: str, request_id: str, choice_indexes: list[int] | None = None) -> None:
        """Tell every engine to stop `request_id` (or some of its choices). A whole-request abort is also
        recorded for abort_record_ttl_s, so a tokenizer or engine that reads the request only later (it
        was down, or the request still queued) drops it instead of running it for nobody."""
        msg = Abort([request_id], choice_indexes=list(choice_indexes or []))
        try:
            if not choice_indexes:
                await self.redis.set(streams.aborted_key(model, request_id), b"1", ex=self.routing.abort_record_ttl_s)
            await self.publisher.publish(streams.control_stream(model), msg, 10_000)
            self.outage.recovered()
        except _REDIS_ERRORS as exc:
            self.outage.failed(f"sending an abort for {request_id}", exc)


def check_runner(entry: ModelEntry, req: ChatRequest | CompletionRequest) -> None:
    """400 (param "model") for an embedding request to a generating model, or generation on an embedding
    model, as vLLM answers: a model serves one kind of request (its engines' --runner)."""
    wants_pooling = isinstance(req, CompletionRequest) and req.pooling is not None
    if not entry.engines or entry.is_pooling == wants_pooling:
        return
    if wants_pooling:
        message = (
            f"The model '{req.model}' is not an embedding model; /v1/embeddings needs an engine run with "
            "--runner pooling"
        )
    else:
        message = f"The model '{req.model}' is an embedding model: it serves /v1/embeddings only, not generation"
    raise APIError(400, message, param="model", code="model_not_supported")


_STOP_TIMEOUT_S = 3.0


def _names(tasks: set[asyncio.Task[Any]]) -> str:
    return ", ".join(sorted(t.get_name() + ":" + repr(t.get_coro()) for t in tasks))
