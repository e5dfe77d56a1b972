"""The engine's publisher: a process of its own that writes one replica's outputs to Redis.

    compute thread ──frames (its stdin)────► publisher process ──XADD ps:{gw}:resp, XACK──► Redis
    (EngineService) ◄──notices (its stdout)── (tokens lost, Redis back)

Why a process: every step publishes a TokenDeltas per gateway. Written by a thread of the engine process,
the Redis client (asyncio, redis-py's pipeline) held the GIL ~1 ms a step, and the step loop waited that
out between its kernels: on an H200 a served SmolLM2 step cost 4.8 ms of host time against 3.4 offline
(bench/results/served_ramp_h200_2026-11-28). Here the compute thread only encodes the messages (msgpack, in
C) and writes them to a pipe; the pipeline, its round trips and the outage handling run in this process.

What it keeps from the thread it replaces: a step's deltas go out in order, ahead of the XACKs of the
requests they end; while Redis is away, outputs stay buffered and go out once it is back (gateways drop a
delta they already have), so an outage shorter than redis_outage_grace_s loses no token; past it, or past
_MAX_BUFFERED_FRAMES, the tokens are lost and the compute thread ends their requests with an error.

The process ignores SIGINT/SIGTERM (the engine decides when to stop, after its drain) and exits on a close
frame or when its stdin ends (the engine is gone), after one last attempt to deliver what it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import msgpack
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pagedserve.shared import streams
from pagedserve.shared.config import Config
from pagedserve.shared.outage import OutageLog
from pagedserve.shared.protocol import KVEvents, RequestError, TokenDeltas, decode_as, encode
from pagedserve.shared.telemetry import setup_logging

log = logging.getLogger(__name__)
_REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
_RECENT_IDS = 10_000  # lost request ids remembered, so none of their later tokens goes out
_MAX_BUFFERED_FRAMES = 50_000  # outputs held through a Redis outage (about a step each), beyond: lost
_KV_EVENTS_MAXLEN = 10_000  # a router that falls further behind catches up from the next snapshot

EntryRef = tuple[str, bytes]  # (stream, entry id): what to XACK once the request ends


# What the compute thread publishes (EngineService._send)
@dataclass(slots=True, frozen=True)
class StepDeltas:
    by_gateway: dict[str, TokenDeltas]
    finished: list[EntryRef]  # requests that ended this step: XACK after their last tokens


@dataclass(slots=True, frozen=True)
class ErrorReply:
    reply_to: str
    error: RequestError
    entry: EntryRef | None  # XACK it too (None: acknowledged already)


@dataclass(slots=True, frozen=True)
class Ack:
    entry: EntryRef


@dataclass(slots=True, frozen=True)
class Close:
    pass


Outbound = StepDeltas | ErrorReply | Ack | KVEvents | Close


def frame_of(item: Outbound) -> list[Any]:
    """The item as the publisher reads it: messages already encoded, so it forwards bytes."""
    match item:
        case StepDeltas(by_gateway, finished):
            return ["deltas", [[gateway, encode(deltas)] for gateway, deltas in by_gateway.items()], finished]
        case ErrorReply(reply_to, error, entry):
            return ["error", reply_to, encode(error), entry]
        case Ack(entry):
            return ["ack", entry]
        case KVEvents():
            return ["kv", encode(item)]
        case Close():
            return ["close"]


# ── engine side ─────────────────────────────────────────────────────────────────────────────────
class PublisherProcess:
    """The engine's handle on its publisher: `send` from one thread (the compute thread); notices come to
    `on_notice` on a thread of their own: ["lost", [[request id, gateway], ...]], ["recovered"], and
    ["gone"] when the process ended without being closed (what it held may be lost)."""

    def __init__(self, config: Config, model: str, on_notice: Callable[[list[Any]], None]) -> None:
        self.on_notice = on_notice
        self._closing = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, "--log-level", config.observability.log_level],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin.fileno(), self.proc.stdout
        self._notices = threading.Thread(target=self._read_notices, name="engine-publisher-notices", daemon=True)
        self._notices.start()
        # the settings go down the pipe, not the command line: a Redis URL may hold a password
        _write_all(self._stdin, msgpack.packb(["config", model, config.to_dict()], use_bin_type=True))

    def send(self, item: Outbound) -> None:
        with contextlib.suppress(OSError):  # it died: the notice thread says so ("gone"); the engine starts another
            _write_all(self._stdin, msgpack.packb(frame_of(item), use_bin_type=True))

    def close(self, timeout: float) -> None:
        """Send what is left, then wait up to `timeout` for it to be delivered."""
        self._closing = True
        self.send(Close())
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the publisher did not finish within %.0f s; stopping it", timeout)
            self.proc.kill()
            self.proc.wait()
        self.release()

    def release(self) -> None:
        """Close this handle's pipes once its process has ended (a dead publisher's, or after `close`)."""
        self._closing = True
        self._notices.join(timeout=1)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        if not self._notices.is_alive():  # never under the notice thread's read
            self.proc.stdout.close()

    def _read_notices(self) -> None:
        unpacker = msgpack.Unpacker(raw=False)
        while chunk := _read_some(self._stdout):
            unpacker.feed(chunk)
            for notice in unpacker:
                self.on_notice(notice)
        if not self._closing:
            code = self.proc.wait()
            log.error("the publisher process exited (code %s) while serving", code)
            self.on_notice(["gone"])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_some(pipe: IO[bytes]) -> bytes:
    try:
        return os.read(pipe.fileno(), 1 << 16)
    except OSError:
        return b""


# ── publisher process ───────────────────────────────────────────────────────────────────────────
class Publisher:
    def __init__(self, redis: Any, config: Config, model: str, notify: Callable[[list[Any]], None]) -> None:
        self.redis, self.notify = redis, notify
        self.group = streams.engine_group(model)
        self.shared_stream = streams.generate_stream(model)
        self.kv_stream = streams.kv_events_stream(model)
        self.maxlen = config.routing.stream_maxlen
        self.grace_s = config.routing.redis_outage_grace_s
        self.outage = OutageLog(log)
        self.lost: OrderedDict[str, None] = OrderedDict()  # requests whose tokens were lost

    async def run(self, frames: asyncio.Queue[list[Any]]) -> None:
        """Every frame that came since the last round trip goes out as one pipeline, until a close frame."""
        buffered: list[list[Any]] = []  # frames whose round trip failed, oldest first
        down_since: float | None = None
        backoff = 0.05
        while True:
            if buffered:  # retry soon even if nothing new comes
                with contextlib.suppress(TimeoutError):
                    buffered.append(await asyncio.wait_for(frames.get(), backoff))
            else:
                buffered.append(await frames.get())
            while not frames.empty():
                buffered.append(frames.get_nowait())
            unsent = await self.send(buffered)
            is_closing = any(frame[0] == "close" for frame in buffered)
            if unsent is None:  # delivered
                buffered, down_since, backoff = [], None, 0.05
                if self.outage.recovered():
                    self.notify(["recovered"])  # Redis may have restarted empty: routers need a KV snapshot
            else:
                down_since = down_since or time.monotonic()
                backoff = min(backoff * 2, 1.0)
                outage_s = time.monotonic() - down_since
                if is_closing or outage_s > self.grace_s or len(buffered) > _MAX_BUFFERED_FRAMES:
                    self.lose(unsent)
                    buffered = []
            if is_closing:
                return

    async def send(self, frames: list[list[Any]]) -> list[tuple[str, bytes]] | None:
        """One pipeline for `frames`; None once Redis has them, else the (gateway, deltas) that did not go out."""
        pipe = self.redis.pipeline(transaction=False)
        acks: list[EntryRef] = []
        sent_deltas: list[tuple[str, bytes]] = []
        for frame in frames:
            match frame:
                case ["deltas", by_gateway, finished]:
                    for gateway, data in by_gateway:
                        kept = self._without_lost(data)
                        if kept is not None:
                            self._xadd(pipe, streams.response_stream(gateway), kept, self.maxlen)
                            sent_deltas.append((gateway, kept))
                    acks.extend(finished)
                case ["error", reply_to, data, entry]:
                    self._xadd(pipe, streams.response_stream(reply_to), data, self.maxlen)
                    if entry is not None:
                        acks.append(entry)
                case ["ack", entry]:
                    acks.append(entry)
                case ["kv", data]:
                    self._xadd(pipe, self.kv_stream, data, _KV_EVENTS_MAXLEN)
        ack_all(pipe, self.group, acks, self.shared_stream)
        try:
            # an XACK whose group a restarted Redis no longer has fails alone; the XADDs still count
            for result in await pipe.execute(raise_on_error=False):
                if isinstance(result, ResponseError):
                    log.debug("an output command failed: %s", result)
        except _REDIS_ERRORS as exc:
            self.outage.failed(f"publishing {len(frames)} outputs", exc)
            return sent_deltas
        return None

    def lose(self, unsent: list[tuple[str, bytes]]) -> None:
        """Tokens that never reached their gateway: send none of those requests' later tokens (the client
        would see a gap) and have the compute thread end them with an error."""
        pairs = [(rid, gateway) for gateway, data in unsent for rid in decode_as(data, TokenDeltas).request_ids]
        new = [(rid, gateway) for rid, gateway in dict.fromkeys(pairs) if rid not in self.lost]
        for rid, _ in new:
            self.lost[rid] = None
        while len(self.lost) > _RECENT_IDS:
            self.lost.popitem(last=False)
        if new:
            self.notify(["lost", new])

    def _without_lost(self, data: bytes) -> bytes | None:
        """The encoded deltas less the requests whose tokens were lost (None: nothing left)."""
        if not self.lost:
            return data
        deltas = decode_as(data, TokenDeltas)
        kept = without_requests(deltas, self.lost)
        if not kept.request_ids:
            return None
        return data if kept is deltas else encode(kept)

    @staticmethod
    def _xadd(pipe: Any, stream: str, data: bytes, maxlen: int) -> None:
        pipe.xadd(stream, {streams.DATA_FIELD: data}, maxlen=maxlen, approximate=True)


def ack_all(pipe: Any, group: str, entries: list[EntryRef] | list[list[Any]], shared_stream: str) -> None:
    """XACK ended requests; on a replica's own stream also delete them, so the stream of a replica that is
    gone empties and can be deleted (the shared stream is trimmed by length instead)."""
    by_stream: dict[str, list[bytes]] = defaultdict(list)
    for stream, entry_id in entries:
        by_stream[stream].append(entry_id)
    for stream, entry_ids in by_stream.items():
        pipe.xack(stream, group, *entry_ids)
        if stream != shared_stream:
            pipe.xdel(stream, *entry_ids)


def without_requests(deltas: TokenDeltas, request_ids: OrderedDict[str, None]) -> TokenDeltas:
    """`deltas` less the columns of `request_ids` (the same object when none of them is in it)."""
    num_rows = len(deltas.request_ids)
    keep = [i for i, rid in enumerate(deltas.request_ids) if rid not in request_ids]
    if len(keep) == num_rows:
        return deltas
    columns: dict[str, Any] = {  # an optional column a sender left empty stays empty
        f.name: [getattr(deltas, f.name)[i] for i in keep]
        for f in dataclasses.fields(deltas)
        if isinstance(getattr(deltas, f.name), list) and len(getattr(deltas, f.name)) == num_rows
    }
    return dataclasses.replace(deltas, **columns)


class _FrameReader(asyncio.Protocol):
    """Frames from the engine (stdin) into a queue; its end is a close frame."""

    def __init__(self, frames: asyncio.Queue[list[Any]]) -> None:
        self.frames, self.unpacker = frames, msgpack.Unpacker(raw=False, max_buffer_size=1 << 30)

    def data_received(self, data: bytes) -> None:
        self.unpacker.feed(data)
        for frame in self.unpacker:
            self.frames.put_nowait(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self.frames.put_nowait(["close"])


async def _serve() -> None:
    frames: asyncio.Queue[list[Any]] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: _FrameReader(frames), sys.stdin.buffer)
    match await frames.get():
        case ["config", str(model), dict(settings)]:
            config = Config.from_dict(settings)
        case _:  # the engine went away before it said what to publish
            return
    stdout = sys.stdout.buffer.fileno()
    redis = streams.connect(config.routing.url)
    publisher = Publisher(redis, config, model, lambda notice: _write_all(stdout, msgpack.packb(notice)))
    try:
        await publisher.run(frames)
    finally:
        if config.runner.profile_steps:
            log.info("engine publisher: %.2f s of CPU", time.process_time())
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description="pagedserve engine publisher (started by an engine replica)")
    parser.add_argument("--log-level", default="INFO")
    setup_logging("engine-publisher", parser.parse_args().log_level)
    # The engine decides when this ends (a close frame after its drain, or its stdin closing): a terminal's
    # Ctrl-C or a supervisor's SIGTERM to the whole process group must not drop the drain's last tokens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    asyncio.run(_serve())


if __name__ == "__main__":
    main()
