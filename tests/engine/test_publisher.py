"""The engine's publisher process: a step's deltas reach each gateway's stream in order, ahead of the XACKs of
the requests they end; its death is noticed; tokens it cannot deliver past the grace are reported lost."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio as aioredis

from pagedserve.services.engine.publisher import (
    ErrorReply,
    Publisher,
    PublisherProcess,
    StepDeltas,
    frame_of,
    without_requests,
)
from pagedserve.shared import streams
from pagedserve.shared.config import Config
from pagedserve.shared.protocol import RequestError, TokenDeltas, decode, decode_as

if TYPE_CHECKING:
    from pagedserve.shared.redis_server import PrivateRedis

MODEL = "pub-test"


def deltas(step: int, request_ids: list[str], finish: str | None = None) -> TokenDeltas:
    n = len(request_ids)
    tokens, finishes = [[step]] * n, [finish] * n
    return TokenDeltas("eng", step, request_ids, [0] * n, tokens, [None] * n, finishes, [3] * n, [step] * n, [0] * n)


def pending_entry(client: Any, stream: str) -> tuple[str, bytes]:
    """An entry read by this engine's group and not yet acknowledged, as a request is while it runs."""
    group = streams.engine_group(MODEL)
    entry_id = client.xadd(stream, {"d": b"x"})
    with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: made by an earlier test
        client.xgroup_create(stream, group, id="0")
    client.xreadgroup(group, "eng", {stream: ">"})
    return (stream, entry_id)


def test_deltas_and_errors_reach_their_gateways_then_the_requests_are_acknowledged(redis_server: PrivateRedis) -> None:
    client: Any = redis.Redis.from_url(redis_server.url)
    shared, own = streams.generate_stream(MODEL), streams.engine_stream(MODEL, "eng")
    done_shared, done_own = pending_entry(client, shared), pending_entry(client, own)
    notices: queue.Queue[list[Any]] = queue.Queue()
    publisher = PublisherProcess(Config.of(redis_url=redis_server.url), MODEL, notices.put)
    publisher.send(StepDeltas({"gw-a": deltas(1, ["r1", "r2"]), "gw-b": deltas(1, ["r3"])}, []))
    publisher.send(StepDeltas({"gw-a": deltas(2, ["r1"], "stop")}, [done_shared, done_own]))
    publisher.send(ErrorReply("gw-b", RequestError("r3", 503, "gone"), None))
    publisher.close(timeout=10)
    assert publisher.proc.returncode == 0 and notices.empty()  # closed, not "gone"

    def messages(gateway: str) -> list[Any]:
        return [decode(f[b"d"]) for _, f in client.xrange(streams.response_stream(gateway))]

    steps_a = [(m.step, m.request_ids, m.finish_reasons) for m in messages("gw-a")]
    assert steps_a == [(1, ["r1", "r2"], [None, None]), (2, ["r1"], ["stop"])]
    to_b = messages("gw-b")
    assert [type(m).__name__ for m in to_b] == ["TokenDeltas", "RequestError"] and to_b[1].status == 503
    group = streams.engine_group(MODEL)
    assert client.xpending(shared, group)["pending"] == 0
    assert client.xpending(own, group)["pending"] == 0
    assert client.xlen(own) == 0  # a replica's own stream is emptied as its requests end
    client.close()


def test_a_publisher_that_dies_is_reported_gone(redis_server: PrivateRedis) -> None:
    notices: queue.Queue[list[Any]] = queue.Queue()
    publisher = PublisherProcess(Config.of(redis_url=redis_server.url), MODEL, notices.put)
    publisher.proc.kill()
    assert notices.get(timeout=10) == ["gone"]
    publisher.send(StepDeltas({"gw-a": deltas(1, ["r1"])}, []))  # into a dead pipe: dropped, not raised
    publisher.release()  # what the engine does before starting another: the dead one's pipes are closed
    assert publisher.proc.stdin is not None and publisher.proc.stdout is not None
    assert publisher.proc.stdin.closed and publisher.proc.stdout.closed
    publisher.send(StepDeltas({"gw-a": deltas(2, ["r1"])}, []))  # still dropped, not raised


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tokens_undelivered_past_the_grace_are_lost_and_their_requests_send_no_more() -> None:
    """Redis unreachable: the frames are retried until the grace passes, then their requests are reported lost
    once each; deltas of a lost request are never sent later (the client would see a gap)."""
    config = Config.of(redis_url=f"redis://127.0.0.1:{_closed_port()}/0", redis_outage_grace_s=0.2)
    notices: list[list[Any]] = []

    async def run() -> float:
        client = aioredis.Redis.from_url(config.routing.url, socket_connect_timeout=0.2)
        publisher = Publisher(client, config, MODEL, notices.append)
        frames: asyncio.Queue[list[Any]] = asyncio.Queue()
        frames.put_nowait(frame_of(StepDeltas({"gw-a": deltas(1, ["r1", "r2"]), "gw-b": deltas(1, ["r3"])}, [])))
        started = time.monotonic()
        task = asyncio.create_task(publisher.run(frames))
        while not notices and time.monotonic() - started < 10:
            await asyncio.sleep(0.02)
        lost_after = time.monotonic() - started
        # later tokens of lost requests are dropped before they are sent
        later = frame_of(StepDeltas({"gw-a": deltas(2, ["r1", "r4"])}, []))
        assert publisher._without_lost(later[1][0][1]) is not None
        kept = decode_as(publisher._without_lost(later[1][0][1]) or b"", TokenDeltas)
        assert kept.request_ids == ["r4"] and kept.token_ids == [[2]]
        frames.put_nowait(["close"])
        await asyncio.wait_for(task, 10)
        await client.aclose()
        return lost_after

    lost_after = asyncio.run(run())
    assert lost_after >= 0.2  # not before the grace
    assert notices[0] == ["lost", [("r1", "gw-a"), ("r2", "gw-a"), ("r3", "gw-b")]]


def test_dropping_requests_keeps_the_other_columns_aligned() -> None:
    original = deltas(5, ["a", "b", "c"])
    kept = without_requests(original, OrderedDict.fromkeys(["b"]))
    assert (kept.request_ids, kept.token_ids, kept.num_output_tokens) == (["a", "c"], [[5], [5]], [5, 5])
    assert kept.prompt_logprobs == [] and kept.embeddings == []  # optional columns left empty stay empty
    assert without_requests(original, OrderedDict.fromkeys(["z"])) is original
