"""The engine service: the Redis side of one engine replica.

    I/O thread (asyncio)                         compute thread (this module's `serve`)
    ─────────────────────                        ──────────────────────────────────────
    XREADGROUP ps:{model}:gen                ┐
             + ps:{model}:gen:{engine id} ───┴─(while room)──►  inbox ──► engine.add_request / abort
    XREAD ps:{model}:ctl (aborts, LoRA) ─────►  inbox          │
    heartbeat key + claim refresh                               ▼ engine.step()
    publisher process (publisher.py):
    XADD ps:{gw}:resp + XACK  ◄────────────── its stdin ◄── one TokenDeltas per gateway per step
    XADD ps:{model}:kv       ◄────────────── its stdin ◄── the prefix blocks cached and evicted (KV events)

The shared stream ps:{model}:gen is pulled by every replica; ps:{model}:gen:{engine id} holds what the
tokenizer's prefix router sent to this replica (services/tokenizer/prefix_router.py). Work left in the
stream of a replica that died (or is draining) is taken over by the others.

The compute loop never waits on Redis; Redis I/O never blocks a step. Entries are acknowledged
only when their request reached a terminal state, so a replica that dies leaves its work pending
for another replica to claim. A step's tokens that cannot be published are lost: those requests end
with an error rather than stream on with a gap. While Redis is down the log gets one warning, then a
reminder every few seconds (shared/outage.py), never a line per failed operation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import random
import sys
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedserve.services.engine.block_pool import KVEventLog
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.lora.manager import UnknownAdapterError
from pagedserve.services.engine.lora_control import LoRAControl
from pagedserve.services.engine.metrics import EngineMetrics
from pagedserve.services.engine.outputs import RequestOutput
from pagedserve.services.engine.publisher import Ack, ErrorReply, Outbound, PublisherProcess, StepDeltas, ack_all
from pagedserve.services.engine.request_trace import RequestTrace, StreamRead
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.step_profile import LoopProfile
from pagedserve.shared import kv_blocks, streams, telemetry
from pagedserve.shared.config import Config
from pagedserve.shared.generation_defaults import fill_sampling, read_generation_defaults
from pagedserve.shared.grammar_spec import GrammarSpec
from pagedserve.shared.outage import OutageLog
from pagedserve.shared.protocol import (
    Abort,
    DecodeError,
    EngineHeartbeat,
    GenerateRequest,
    KVEvents,
    LoRAUpdate,
    RequestError,
    TokenDeltas,
    decode,
    decode_as,
    encode,
)

log = logging.getLogger(__name__)
_REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
_RECENT_IDS = 10_000  # finished or aborted request ids remembered to drop late duplicates
_UNAVAILABLE = "service_unavailable_error"
_READ_BLOCK_MS = (100, 300)  # how long a read of new requests waits, drawn afresh each time
_KV_EVENT_INTERVAL_S = 0.02  # at most 50 KV events a second per replica: each one costs every router a read


EntryRef = tuple[str, bytes]  # (stream, entry id): what to XACK once the request ends


# What the I/O thread hands the compute loop (the inbox)...
@dataclass(slots=True, frozen=True)
class _Generate:
    entry: EntryRef
    request: GenerateRequest
    read_at_ns: int  # when the I/O thread read it: the end of its stream.wait span


@dataclass(slots=True, frozen=True)
class _Lost:
    requests: list[tuple[str, str]]  # (request id, gateway): tokens that never reached the gateway


@dataclass(slots=True, frozen=True)
class _Wake:
    """Nothing to do but look at the stop flag."""


@dataclass(slots=True, frozen=True)
class _PublisherGone:
    """The publisher process died: what it held may be lost."""


_Inbound = _Generate | Abort | LoRAUpdate | _Lost | _Wake | _PublisherGone


@dataclass(slots=True)
class _Active:
    entry: EntryRef
    reply_to: str
    num_choices: int
    trace: RequestTrace
    num_finished: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # of the choice that finished last


def sampling_params_from_wire(sampling: Mapping[str, Any]) -> SamplingParams:
    """Build and validate SamplingParams from a wire dict (logit_bias keys arrive as strings)."""
    fields = dict(sampling)
    if fields.get("structured_output") is not None:
        fields["structured_output"] = GrammarSpec.from_wire(fields["structured_output"])
    if fields.get("logit_bias"):
        fields["logit_bias"] = {int(k): float(v) for k, v in fields["logit_bias"].items()}
    params = SamplingParams(**fields)
    params.validate()
    return params


class EngineService:
    def __init__(
        self, config: Config, model: str, engine: Engine, model_source: str | None, metrics: EngineMetrics | None = None
    ) -> None:
        self.config = config
        self.settings = config.engine
        self.routing = config.routing
        self.model, self.engine = model, engine
        self.metrics = metrics
        self._queued: dict[str, RequestTrace] = {}  # traces of requests not scheduled yet
        self.model_source = model_source
        self.generation_defaults = read_generation_defaults(config.model.generation_config, engine.model_dir)
        self.inbox: queue.Queue[_Inbound] = queue.Queue()
        self.active: dict[str, _Active] = {}
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.has_room = threading.Event()
        self.has_room.set()
        self.num_wanted = engine.num_wanted()
        self.stopping = threading.Event()
        self.drain_deadline = float("inf")
        self.step_count = 0
        self.num_requests_finished = 0
        self.last_stats = engine.stats()
        self.redis_ok = False  # the last heartbeat reached Redis
        self.publisher: PublisherProcess | None = None  # started by serve()
        self._loop: asyncio.AbstractEventLoop | None = None  # the I/O thread's
        self._io_done: asyncio.Event | None = None  # set by serve() when it ends: the I/O thread stops
        self._io_ready = threading.Event()
        self._io_thread = threading.Thread(target=self._run_io, name="engine-redis-io", daemon=True)
        self.outage = OutageLog(log)  # I/O thread only
        self.shared_stream = streams.generate_stream(model)
        self.own_stream = streams.engine_stream(model, self.settings.engine_id)
        self._orphan_readers: dict[str, streams.GroupReader] = {}  # I/O thread only: dead replicas' streams
        # I/O thread only: request id -> the gateway process it came from (its record), and gateway id -> since
        # when its record is missing (see _stop_orphaned)
        self._gateway_process: dict[str, bytes] = {}
        self._gateway_missing: dict[str, float] = {}
        self.pool = engine.kv_cache.pool
        if engine.kv_cache.enable_prefix_caching:
            self.pool.event_log = KVEventLog()
            if engine.kv_cache.host is not None:
                engine.kv_cache.host.records_events = True
        self._snapshot_due = 0.0  # monotonic time of the next full KV snapshot (0: at once)
        self._last_load: tuple[int, int, int] | None = None  # (running, waiting, used blocks) last published
        self._last_kv_event = 0.0  # monotonic time of the last KV event
        self.lora = LoRAControl(engine)
        self.loop_profile = LoopProfile(enabled=engine.profile.enabled)

    # ── compute side ──────────────────────────────────────────────────────────────────────────
    def serve(self) -> None:
        """Run until `stop()` and the drain: start the I/O thread, then step the engine whenever there is work.

        After `stop()` the replica pulls no new work and says so in its heartbeat (gateways stop
        counting it as live), finishes what it holds until `drain_timeout_s`, and exits; whatever is
        left unfinished is taken over by other replicas once its heartbeat record is gone."""
        # The I/O thread must not wait out the default 5 ms GIL switch interval while this loop runs
        # Python between kernels: that wait would be added to every request's first token.
        sys.setswitchinterval(0.0005)
        self._start_publisher()
        self._io_thread.start()
        self._io_ready.wait()
        log.info("engine %s serving %s", self.settings.engine_id, self.model)
        profile = self.loop_profile
        while not self._is_done():
            is_idle = not self.engine.has_unfinished()
            if is_idle and profile.num_steps:
                self._log_profile("busy period")  # one line per burst of work: a warm-up apart from a run
            profile.start()
            self._drain_inbox(block=is_idle)
            profile.mark("idle" if is_idle else "inbox")
            if self.engine.has_unfinished():
                profile.num_steps += 1
                try:
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    step_seconds = time.perf_counter() - started
                    profile.mark("step")
                    self._track_admissions()
                    self._publish_step(outputs)
                    if self.metrics is not None:
                        self.metrics.observe_step(step_seconds, self.engine.stats())
                    profile.mark("publish")
                except Exception:  # a bug must not take every request of this replica down with it
                    log.exception("engine step failed; ending the running requests with an error")
                    self._fail_active("internal engine error")
            self._update_room()
            self._publish_kv_events()
            profile.mark("room")
        assert self.publisher is not None and self._loop is not None and self._io_done is not None
        self.publisher.close(timeout=5)  # the drain's last tokens and XACKs, before the heartbeat goes
        self._loop.call_soon_threadsafe(self._io_done.set)
        self._io_thread.join(timeout=5)
        profile.note_thread_cpu("compute")
        self._log_profile("exit")

    def _log_profile(self, when: str) -> None:
        """Log the step and loop profiles (when on) since the last such line, and start them afresh."""
        if not self.loop_profile.enabled:
            return
        summary = {"at": when, "steps": self.engine.profile.summary(), "loop": self.loop_profile.summary()}
        log.info("engine %s step profile: %s", self.settings.engine_id, json.dumps(summary))
        self.engine.profile.reset()
        self.loop_profile.reset()

    def stop(self) -> None:
        """Begin draining; a second call stops at once."""
        now = time.monotonic()
        self.drain_deadline = now if self.stopping.is_set() else now + self.settings.drain_timeout_s
        self.stopping.set()
        self.inbox.put(_Wake())
        log.info("engine %s draining %d requests", self.settings.engine_id, len(self.active))

    def is_ready(self) -> bool:
        """Serving: connected to Redis and not draining (the ops port's /ready)."""
        return self._io_ready.is_set() and self.redis_ok and not self.stopping.is_set()

    def _is_done(self) -> bool:
        return self.stopping.is_set() and (not self.active or time.monotonic() >= self.drain_deadline)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            match item:
                case _Generate(entry, request, read_at_ns):
                    self._add(entry, request, read_at_ns)
                case Abort(request_ids=request_ids, choice_indexes=choice_indexes):
                    self._abort(request_ids, choice_indexes)
                case LoRAUpdate():
                    self.lora.apply(item)
                case _Lost(requests):
                    self._fail_lost(requests)
                case _PublisherGone():
                    self._replace_publisher()
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _abort(self, request_ids: list[str], choice_indexes: list[int]) -> None:
        if choice_indexes:  # a stop string ended some choices of an n > 1 request; the rest go on
            for rid in request_ids:
                self.engine.abort_choices(rid, choice_indexes)
            return
        self.engine.abort([rid for rid in request_ids if rid in self.active])
        for rid in request_ids:  # an abort may overtake its request (client gone while tokenizing)
            if rid not in self.active:
                self._remember(rid)

    def _add(self, entry: EntryRef, req: GenerateRequest, read_at_ns: int | None = None) -> None:
        """`read_at_ns`: when the I/O thread read it from `entry`; its stream.wait span is recorded when its
        trace ends (or now, if it is not taken)."""
        read = None if read_at_ns is None else (entry[0], entry[1], read_at_ns)
        if not self._start(entry, req, read) and read is not None:
            telemetry.record_stream_wait(read[0], read[1], req.traceparent, read[2])

    def _start(self, entry: EntryRef, req: GenerateRequest, read: StreamRead | None) -> bool:
        """Hand the request to the engine; False if it was not taken (a duplicate, or answered with an error)."""
        if req.request_id in self.active or req.request_id in self.recent:
            if req.request_id not in self.active:
                self._send(Ack(entry))  # finished, aborted, or a redelivered duplicate
            return False
        try:
            if req.pooling is not None:  # /v1/embeddings: a forward pass, no sampling parameters
                params = SamplingParams(max_tokens=1)
                resumed = None
                dimensions = req.pooling.get("dimensions")
                self.engine.add_embedding_request(req.request_id, req.prompt_token_ids, dimensions)
            else:
                params = sampling_params_from_wire(fill_sampling(req.sampling, self.generation_defaults))
                resumed = _resumed_choices(req)
                self.engine.add_request(
                    req.request_id, req.prompt_token_ids, params, req.output_token_ids, resumed, lora_name=req.lora_name
                )
        except UnknownAdapterError:  # unloaded after the gateway looked, or never loaded here
            message = f"The model '{req.lora_name}' does not exist"
            error = RequestError(req.request_id, 404, message, param="model", code="model_not_found")
            self._send(ErrorReply(req.reply_to, error, entry))
            return False
        except (TypeError, ValueError) as exc:
            param = str(exc).split(":", 1)[0] if ":" in str(exc) else None
            what = "invalid input" if req.pooling is not None else "invalid sampling parameters"
            error = RequestError(req.request_id, 400, f"{what}: {exc}", param=param)
            self._send(ErrorReply(req.reply_to, error, entry))
            return False
        trace = RequestTrace(req, self.settings.engine_id, read)
        num_choices = params.n if resumed is None else len(resumed)
        self.active[req.request_id] = _Active(entry, req.reply_to, num_choices, trace)
        self._queued[req.request_id] = trace
        return True

    def _track_admissions(self) -> None:
        """End the queue phase of requests the last step scheduled for the first time."""
        for request_id in [rid for rid in self._queued if self.engine.is_admitted(rid)]:
            trace = self._queued.pop(request_id)
            if not trace.is_admitted:
                wait = trace.admitted()
                if self.metrics is not None:
                    self.metrics.queue_wait.observe(wait)

    def _publish_step(self, outputs: list[RequestOutput]) -> None:
        self.step_count += 1
        by_gateway: dict[str, list[RequestOutput]] = defaultdict(list)
        finished_entries: list[EntryRef] = []
        ended: list[tuple[_Active, str]] = []  # traces to end once the tokens are on their way
        active = self.active
        for out in outputs:
            state = active.get(out.request_id)
            if state is None:
                continue
            by_gateway[state.reply_to].append(out)
            if out.new_token_ids and not state.trace.has_first_token:
                self._queued.pop(out.request_id, None)
                state.trace.first_token()
            if out.finish_reason is not None:
                state.num_finished += 1
                state.num_output_tokens += out.num_output_tokens
                if state.num_finished >= state.num_choices:
                    self._queued.pop(out.request_id, None)
                    ended.append((state, out.finish_reason))
                    state.num_cached_tokens = out.num_cached_tokens
                    finished_entries.append(state.entry)
                    self.num_requests_finished += 1
                    del active[out.request_id]
                    self._remember(out.request_id)
        if by_gateway:
            deltas = {gateway: self._deltas(outs) for gateway, outs in by_gateway.items()}
            self._send(StepDeltas(deltas, finished_entries))
        for state, finish_reason in ended:
            state.trace.finish(finish_reason, state.num_output_tokens, state.num_cached_tokens)

    def _deltas(self, outs: list[RequestOutput]) -> TokenDeltas:
        """One gateway's share of a step, column by column (a comprehension a column: this runs for every
        request every step, on the compute thread)."""
        return TokenDeltas(
            self.settings.engine_id,
            self.step_count,
            [o.request_id for o in outs],
            [o.index for o in outs],
            [o.new_token_ids for o in outs],  # fresh lists (the engine keeps none), encoded before the next step
            [None if o.new_logprobs is None else _wire_logprobs(o.new_logprobs) for o in outs],
            [o.finish_reason for o in outs],
            [o.num_prompt_tokens for o in outs],
            [o.num_output_tokens for o in outs],
            [o.num_cached_tokens for o in outs],
            [None if o.prompt_logprobs is None else _wire_prompt_logprobs(o.prompt_logprobs) for o in outs],
            [o.embedding for o in outs],
        )

    def _fail_active(self, message: str) -> None:
        self._fail(list(self.active), 500, message, "internal_server_error")

    def _fail(self, request_ids: list[str], status: int, message: str, error_type: str) -> None:
        """End active requests with an error to their gateways."""
        self.engine.abort(request_ids)  # frees their blocks at once
        for request_id in request_ids:
            state = self.active.pop(request_id)
            self._queued.pop(request_id, None)
            error = RequestError(request_id, status, message, type=error_type)
            self._send(ErrorReply(state.reply_to, error, state.entry))
            state.trace.fail(message)
            self._remember(request_id)

    def _fail_lost(self, lost: list[tuple[str, str]]) -> None:
        """(request id, gateway) pairs whose tokens could not be published: end them with an error."""
        message = "tokens of this request were lost: the engine could not reach Redis"
        active = [rid for rid, _ in lost if rid in self.active]
        self._fail(active, 503, message, _UNAVAILABLE)
        for rid, reply_to in lost:  # finished in the very step whose tokens were lost: tell the gateway too
            if rid not in active:
                self._send(ErrorReply(reply_to, RequestError(rid, 503, message, type=_UNAVAILABLE), None))

    def _publish_kv_events(self) -> None:
        """What the prefix cache gained and lost since the last event, and the load, as one KV event when
        either changed (at most one per step and per _KV_EVENT_INTERVAL_S); every kv_snapshot_interval_s,
        and at once after a Redis outage, all the cached blocks instead."""
        if self.pool.event_log is None:
            return
        now = time.monotonic()
        if now - self._last_kv_event < _KV_EVENT_INTERVAL_S and now < self._snapshot_due:
            return  # the log keeps accumulating: routers need not hear of every step
        stored, removed, reset = self.pool.drain_events()
        host = self.engine.kv_cache.host
        host_stored, host_removed = host.drain_events() if host is not None else ([], [])
        stats = self.last_stats
        load = (stats.num_running, stats.num_waiting, stats.num_total_blocks - stats.num_free_blocks)
        is_snapshot = reset or now >= self._snapshot_due
        if not (is_snapshot or stored or removed or host_stored or host_removed or load != self._last_load):
            return
        self._last_load, self._last_kv_event = load, now
        wire = kv_blocks.wire_id
        if is_snapshot:
            self._snapshot_due = time.monotonic() + self.routing.kv_snapshot_interval_s
            stored, removed = self.pool.cached_hashes(), []
            host_stored, host_removed = (host.cached_hashes() if host is not None else []), []
        events = KVEvents(
            self.settings.engine_id,
            self.engine.kv_cache.block_size,
            [wire(h) for h in stored],
            [wire(h) for h in removed],
            is_snapshot,
            time.time(),
            *load,
            [wire(h) for h in host_stored],
            [wire(h) for h in host_removed],
        )
        self._send(events)

    def _remember(self, request_id: str) -> None:
        self.recent[request_id] = None
        if len(self.recent) > _RECENT_IDS:
            self.recent.popitem(last=False)

    def _update_room(self) -> None:
        self.last_stats = self.engine.stats()  # a snapshot the I/O thread may read
        if self.metrics is not None:
            self.metrics.observe_load(self.last_stats)
        self.num_wanted = self.engine.num_wanted()  # read by the I/O thread
        if self.num_wanted > 0:
            self.has_room.set()
        else:
            self.has_room.clear()

    def _send(self, item: Outbound) -> None:
        assert self.publisher is not None
        self.publisher.send(item)

    def _start_publisher(self) -> None:
        self.publisher = PublisherProcess(self.config, self.model, self._on_publisher_notice)

    def _on_publisher_notice(self, notice: list[Any]) -> None:
        """From the publisher's notice thread."""
        match notice:
            case ["lost", pairs]:
                self.inbox.put(_Lost([(rid, gateway) for rid, gateway in pairs]))
            case ["recovered"]:
                self._snapshot_due = 0.0  # Redis may have restarted empty: routers rebuild from a snapshot
            case ["gone"]:
                self.inbox.put(_PublisherGone())

    def _replace_publisher(self) -> None:
        """Start a new publisher; the running requests end with an error (the old one may have lost tokens of
        theirs: better an error than a stream with a gap)."""
        assert self.publisher is not None
        self.publisher.release()
        self._start_publisher()
        message = "tokens of this request were lost: the engine's publisher died"
        self._fail(list(self.active), 503, message, _UNAVAILABLE)

    # ── I/O side (its own thread and event loop) ─────────────────────────────────────────────
    def _run_io(self) -> None:
        asyncio.run(self._io_main())

    async def _io_main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._io_done = asyncio.Event()
        redis = streams.connect(self.routing.url)
        reader = streams.GroupReader(
            redis,
            [self.shared_stream, self.own_stream],
            streams.engine_group(self.model),
            self.settings.engine_id,
            claim_idle_ms=self.settings.claim_idle_ms,
            # a replica whose heartbeat key expired (hung, dead) loses its pending entries at once:
            # consumer names are engine ids; the grace spares a replica that has not beaten yet
            heartbeat_key=lambda consumer: streams.engine_key(self.model, consumer),
            dead_grace_ms=int(2_000 * self.settings.heartbeat_interval_s),
        )
        self._io_ready.set()
        if self.lora.max_lora_rank:
            await self._replay_runtime_loras(redis)
        tasks = [
            asyncio.create_task(self._read_requests(reader), name="read requests"),
            asyncio.create_task(self._read_aborts(redis), name="read aborts"),
            asyncio.create_task(self._heartbeat(redis, reader), name="heartbeat"),
        ]
        for task in tasks:  # none is meant to end before shutdown: one that does must not do so unseen
            task.add_done_callback(_log_if_failed)
        try:
            await self._io_done.wait()
        finally:
            self.loop_profile.note_thread_cpu("io")
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await redis.delete(streams.engine_key(self.model, self.settings.engine_id))
            await redis.aclose()

    async def _read_requests(self, reader: streams.GroupReader) -> None:
        while True:
            try:
                await reader.ensure_group()
                break
            except _REDIS_ERRORS as exc:
                await self._backoff("connecting", exc)
        while True:
            wanted = self._wanted()
            if wanted <= 0 or self.stopping.is_set():
                await asyncio.sleep(0.01)
                continue
            try:
                # a random block: replicas that re-read on a fixed period phase-lock, and then one of them
                # would be first in Redis's queue for every request of a steady trickle
                block_ms = random.randint(*_READ_BLOCK_MS)
                await self._take(reader, await reader.read(count=wanted, block_ms=block_ms))
                if time.monotonic() >= reader.next_claim:
                    await self._take(reader, await reader.claim_stale_if_due(count=8))
                    try:
                        await self._take_orphans(reader)
                    except ResponseError as exc:  # a stream changing under us (another replica took it)
                        log.warning("could not take over orphaned requests: %s", exc)
                if self.outage.recovered():
                    self._snapshot_due = 0.0  # Redis may have restarted empty: routers rebuild from a snapshot
            except _REDIS_ERRORS as exc:
                await self._backoff("reading requests", exc)
            except Exception:  # a bug here must not leave the replica beating but deaf
                log.exception("reading requests failed; reading on")
                await asyncio.sleep(0.5)

    def _wanted(self) -> int:
        """How many requests to read at once: what the engine wants (Engine.num_wanted) less what is
        already on its way to it, so a burst is taken in a few round trips and never hoarded (while a
        long step runs, the compute thread's figure is stale: what the inbox holds counts against it)."""
        return self.num_wanted - self.inbox.qsize() if self.has_room.is_set() else 0

    async def _take_orphans(self, reader: streams.GroupReader) -> None:
        """Work a router sent to a replica that is gone (its heartbeat expired) or draining (it takes no new
        work) is taken by this one: a gone replica's pending entries too, as from the shared stream."""
        redis = reader.redis
        async for raw in redis.scan_iter(match=streams.engine_stream_pattern(self.model), count=500):
            stream = raw.decode() if isinstance(raw, bytes) else raw
            engine_id = stream.rsplit(":", 1)[1]
            if stream == self.own_stream:
                continue
            beat: Any = await redis.get(streams.engine_key(self.model, engine_id))
            is_gone = beat is None
            if not is_gone and not decode_as(beat, EngineHeartbeat).is_draining:
                continue
            orphans = self._orphan_readers.get(stream)
            if orphans is None:
                orphans = self._orphan_readers[stream] = streams.GroupReader(
                    redis,
                    stream,
                    reader.group,
                    self.settings.engine_id,
                    heartbeat_key=lambda consumer: streams.engine_key(self.model, consumer),
                    dead_grace_ms=reader.dead_grace_ms,
                )
                await orphans.ensure_group()
            wanted = self._wanted()
            # read before claiming: a fresh reader first re-reads its own pending entries, which would
            # deliver what it just claimed a second time
            entries = await orphans.read(count=wanted, block_ms=None) if wanted > 0 else []
            if not entries and wanted > 0:  # a fresh reader's first read was of its own pending entries
                entries = await orphans.read(count=wanted, block_ms=None)
            if is_gone:
                entries += await orphans.claim_dead(count=8)
            if entries:
                log.info(
                    "took %d requests left on %s (its replica is %s)",
                    len(entries),
                    stream,
                    "gone" if is_gone else "draining",
                )
            await self._take(orphans, entries)
            # emptied: delete it, unless a router sent more meanwhile (atomic)
            if is_gone and not entries and await _delete_if_empty(redis, stream):
                self._orphan_readers.pop(stream, None)

    async def _take(self, reader: streams.GroupReader, entries: list[streams.Entry]) -> None:
        read_at = time.time_ns()
        requests = []
        for entry in entries:
            if isinstance(entry.message, GenerateRequest):
                # the compute thread records its stream.wait span when the request ends, off the path of its tokens
                self.inbox.put(_Generate((entry.stream, entry.entry_id), entry.message, read_at))
                if self.metrics is not None:
                    self.metrics.stream_wait.observe(telemetry.stream_wait_s(entry.entry_id, read_at))
                requests.append(entry.message.request_id)
            else:
                log.error("unexpected %s on the generate stream; skipped", type(entry.message).__name__)
                await self._ack(reader.redis, reader.group, entry)
        # What the gateway gave up on while this replica was down or busy is stopped, not run for nobody. Asked
        # after the requests went in, not before: the round trip stays off their first token, and one that was
        # given up on runs a step at most before the abort reaches the engine.
        given_up = await streams.aborted_ids(reader.redis, self.model, requests)
        if given_up:
            log.info("requests %s were aborted before this engine took them; stopped", sorted(given_up))
            self.inbox.put(Abort(sorted(given_up), reason="aborted before this engine took it"))

    async def _ack(self, redis: Any, group: str, entry: streams.Entry) -> None:
        pipe = redis.pipeline(transaction=False)
        ack_all(pipe, group, [(entry.stream, entry.entry_id)], self.shared_stream)
        await pipe.execute()

    async def _read_aborts(self, redis: Any) -> None:
        stream, last_id = streams.control_stream(self.model), "$"
        while True:
            try:
                reply = await redis.xread({stream: last_id}, block=1000, count=256)
            except _REDIS_ERRORS as exc:
                await self._backoff("reading aborts", exc)
                continue
            for _, items in reply or []:
                for entry_id, fields in items:
                    last_id = entry_id
                    try:
                        msg = decode(fields.get(streams.DATA_FIELD, b""))
                    except DecodeError as exc:
                        log.error("skipping undecodable control entry %s: %s", entry_id, exc)
                        continue
                    if isinstance(msg, Abort | LoRAUpdate):
                        self.inbox.put(msg)

    async def _replay_runtime_loras(self, redis: Any) -> None:
        """Load the adapters loaded at run time before this replica started (best effort: Redis may be down)."""
        try:
            loaded = await redis.hgetall(streams.lora_key(self.model))
        except RedisError as exc:
            log.warning("could not read the runtime LoRA adapters: %s", exc)
            return
        for name, path in sorted(loaded.items()):
            as_text = [v.decode() if isinstance(v, bytes) else str(v) for v in (name, path)]
            self.inbox.put(LoRAUpdate("replay", "load", *as_text))

    async def _heartbeat(self, redis: Any, reader: streams.GroupReader) -> None:
        key = streams.engine_key(self.model, self.settings.engine_id)
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        last_beat = time.monotonic()
        while True:
            stats = self.last_stats
            beat = EngineHeartbeat(
                engine_id=self.settings.engine_id,
                model=self.model,
                max_model_len=self.engine.max_model_len,
                num_running=stats.num_running,
                num_waiting=stats.num_waiting,
                num_free_blocks=stats.num_free_blocks,
                num_total_blocks=stats.num_total_blocks,
                is_draining=self.stopping.is_set(),
                time=time.time(),
                model_source=self.model_source,
                supports_choice_abort=True,
                supports_choice_continuation=True,
                num_requests_finished=self.num_requests_finished,
                block_size=self.engine.kv_cache.block_size if self.pool.event_log is not None else 0,
                runner="generate" if self.engine.pooling is None else "pooling",
                max_lora_rank=self.lora.max_lora_rank,
                lora_adapters=self.lora.adapters,
                lora_resident=self.lora.resident,
                lora_errors=self.lora.errors,
            )
            try:
                await redis.set(key, encode(beat), px=ttl_ms)
                by_stream: dict[str, list[bytes]] = defaultdict(list)
                for active in list(self.active.values()):
                    by_stream[active.entry[0]].append(active.entry[1])
                for stream, entry_ids in by_stream.items():
                    await reader.refresh_claims(entry_ids, stream=stream)
                await self._stop_orphaned(redis)
                # Redis may have restarted empty, or our record expired (we were stopped) and routers forgot
                # this replica's blocks: publish all of them again
                if self.outage.recovered() or time.monotonic() - last_beat > self.settings.heartbeat_ttl_s:
                    self._snapshot_due = 0.0
                last_beat = time.monotonic()
                self.redis_ok = True
            except RedisError as exc:  # any: a heartbeat that stops for good makes the replica look dead
                self.redis_ok = False
                self._gateway_missing.clear()  # a gateway's record is missing only while Redis is up
                self.outage.failed("sending the heartbeat", exc)
            # while Redis is away, try often: the replica is registered again as soon as it is back
            await asyncio.sleep(self.settings.heartbeat_interval_s if self.redis_ok else 0.2)

    async def _stop_orphaned(self, redis: Any) -> None:
        """Abort the requests of a gateway process that is gone, rather than run them for nobody: its record
        (streams.gateway_key) has been missing for longer than the Redis outage a gateway waits out (it may
        only have lost Redis), or names another process (a worker that replaced it). A request whose gateway
        had no record when first looked at here (an older gateway) runs on."""
        owners = [(request_id, state.reply_to) for request_id, state in list(self.active.items())]
        gateways = sorted({gateway for _, gateway in owners})
        if not gateways:
            self._gateway_process, self._gateway_missing = {}, {}
            return
        async with redis.pipeline(transaction=False) as pipe:  # one round trip; no cross-slot MGET
            for gateway in gateways:
                pipe.get(streams.gateway_key(gateway))
            records = dict(zip(gateways, await pipe.execute(), strict=True))
        now, grace = time.monotonic(), max(self.routing.redis_outage_grace_s, 2 * streams.GATEWAY_BEAT_S)
        self._gateway_missing = {g: self._gateway_missing.get(g, now) for g in gateways if records[g] is None}
        seen, self._gateway_process = self._gateway_process, {}
        orphans: dict[str, list[str]] = defaultdict(list)
        for request_id, gateway in owners:
            process, known = records[gateway], seen.get(request_id)
            if known is None:  # first looked at (or its gateway never kept a record)
                if process is not None:
                    self._gateway_process[request_id] = process
            elif process == known or (process is None and now - self._gateway_missing[gateway] <= grace):
                self._gateway_process[request_id] = known
            else:
                orphans[gateway].append(request_id)
        for gateway, request_ids in orphans.items():
            log.warning("gateway %s is gone: stopping its %d requests", gateway, len(request_ids))
            self.inbox.put(Abort(request_ids, reason="gateway gone"))

    async def _backoff(self, doing: str, exc: BaseException) -> None:
        self.outage.failed(doing, exc)
        await asyncio.sleep(0.5)


_DELETE_IF_EMPTY = "if redis.call('XLEN', KEYS[1]) == 0 then return redis.call('DEL', KEYS[1]) end return 0"


async def _delete_if_empty(redis: Any, stream: str) -> bool:
    return bool(await redis.eval(_DELETE_IF_EMPTY, 1, stream))


def _resumed_choices(req: GenerateRequest) -> dict[int, list[int]] | None:
    """An n > 1 continuation's choices (index -> tokens so far), or None for a whole request."""
    if not req.choice_indexes and not req.choice_output_token_ids:
        return None
    if len(req.choice_indexes) != len(req.choice_output_token_ids) or len(set(req.choice_indexes)) != len(
        req.choice_indexes
    ):
        raise ValueError("choice_indexes: one distinct index per choice_output_token_ids list")
    return dict(zip(req.choice_indexes, req.choice_output_token_ids))


def _wire_logprobs(logprobs: Any) -> list[Any]:
    return [[lp.logprob, [[t, v] for t, v in lp.top_logprobs]] for lp in logprobs]


def _wire_prompt_logprobs(logprobs: Any) -> list[Any]:
    return [None if lp is None else [lp.logprob, [[t, v] for t, v in lp.top_logprobs]] for lp in logprobs]


def _log_if_failed(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the engine's I/O task %s ended", task.get_name(), exc_info=task.exception())
