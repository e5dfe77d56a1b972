"""The engine service never publishes tokens of a request whose earlier tokens were lost; it ends it."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.publisher import without_requests
from pagedserve.services.engine.service import EngineService
from pagedserve.shared import streams
from pagedserve.shared.config import Config
from pagedserve.shared.protocol import GenerateRequest, TokenDeltas

if TYPE_CHECKING:
    from pagedserve.shared.redis_server import PrivateRedis


def deltas() -> TokenDeltas:
    return TokenDeltas(
        "eng",
        7,
        ["a", "b", "a"],
        [0, 0, 1],
        [[1], [2], [3]],
        [None, None, None],
        [None, "length", None],
        [4, 5, 4],
        [1, 9, 1],
        [0, 0, 0],
    )


def test_lost_requests_are_dropped_column_by_column() -> None:
    kept = without_requests(deltas(), OrderedDict.fromkeys(["a"]))
    assert (kept.engine_id, kept.step) == ("eng", 7)
    assert (kept.request_ids, kept.indexes, kept.token_ids, kept.finish_reasons) == (["b"], [0], [[2]], ["length"])
    assert (kept.num_prompt_tokens, kept.num_output_tokens, kept.num_cached_tokens, kept.logprobs) == (
        [5],
        [9],
        [0],
        [None],
    )


def test_nothing_lost_keeps_the_message() -> None:
    original = deltas()
    assert without_requests(original, OrderedDict.fromkeys(["zzz"])) is original
    assert without_requests(original, OrderedDict.fromkeys(["a", "b"])).request_ids == []


def test_a_request_whose_tokens_were_lost_ends_with_an_error(tiny_model: CausalLM, tiny_model_dir: Path) -> None:
    engine = Engine(Config.of(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4), model=tiny_model)
    service = EngineService(Config.of(engine_id="eng-test"), "m", engine, model_source=None)
    sent: list[Any] = []
    service._send = sent.append  # type: ignore[method-assign,assignment]  # what the I/O thread publishes
    params = {"temperature": 0.0, "max_tokens": 50, "ignore_eos": True}
    service._add(b"1-0", GenerateRequest("running", "gw1", "m", [5, 6, 7], params))
    service._publish_step(engine.step())
    sent.clear()
    service._fail_lost([("running", "gw1"), ("finished", "gw2")])  # "finished": ended in the lost step
    assert "running" not in service.active and "running" in service.recent
    errors = [(e.reply_to, e.error.request_id, e.error.status, e.entry) for e in sent]
    assert errors == [("gw1", "running", 503, b"1-0"), ("gw2", "finished", 503, None)]
    while engine.has_unfinished():  # the engine dropped the sequence and freed its blocks
        engine.step()
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_a_request_given_up_before_the_engine_took_it_is_stopped(
    tiny_model: CausalLM, tiny_model_dir: Path, redis_server: PrivateRedis
) -> None:
    """The abort record is looked up after the request went in (off its first token); a hit aborts it."""
    engine = Engine(Config.of(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4), model=tiny_model)
    service = EngineService(Config.of(engine_id="eng-take"), "m", engine, model_source=None)
    params = {"temperature": 0.0, "max_tokens": 50, "ignore_eos": True}
    entries = [
        streams.Entry(b"1-0", GenerateRequest("wanted", "gw1", "m", [5, 6, 7], params)),
        streams.Entry(b"2-0", GenerateRequest("given-up", "gw1", "m", [5, 6, 8], params)),
    ]

    async def take() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        await client.set(streams.aborted_key("m", "given-up"), b"1")
        await service._take(SimpleNamespace(redis=client, group="g"), entries)
        await client.aclose()

    asyncio.run(take())
    inbox = [service.inbox.get_nowait() for _ in range(service.inbox.qsize())]
    assert [type(item).__name__ for item in inbox] == ["_Generate", "_Generate", "Abort"]
    assert inbox[2].request_ids == ["given-up"]
    for item in inbox:
        service.inbox.put(item)
    sent: list[Any] = []
    service._send = sent.append  # type: ignore[method-assign,assignment]  # what the I/O thread publishes
    service._drain_inbox(block=False)  # in, then stopped, before any step ran
    service._publish_step(engine.step())
    assert set(service.active) == {"wanted"}
    given_up = [
        (tokens, reason)
        for message in sent
        for deltas in message.by_gateway.values()
        for rid, tokens, reason in zip(deltas.request_ids, deltas.token_ids, deltas.finish_reasons, strict=True)
        if rid == "given-up"
    ]
    assert given_up == [([], "abort")]  # ended, with no token computed for it


def test_when_the_publisher_dies_a_new_one_starts_and_running_requests_end_with_an_error(
    tiny_model: CausalLM, tiny_model_dir: Path
) -> None:
    engine = Engine(Config.of(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4), model=tiny_model)
    service = EngineService(Config.of(engine_id="eng-pub"), "m", engine, model_source=None)
    sent: list[Any] = []
    started: list[bool] = []
    service._send = sent.append  # type: ignore[method-assign,assignment]  # what the publisher gets
    service._start_publisher = lambda: started.append(True)  # type: ignore[method-assign]
    released: list[bool] = []
    service.publisher = SimpleNamespace(release=lambda: released.append(True))  # type: ignore[assignment]
    params = {"temperature": 0.0, "max_tokens": 50, "ignore_eos": True}
    service._add(b"1-0", GenerateRequest("running", "gw1", "m", [5, 6, 7], params))
    service._publish_step(engine.step())
    sent.clear()
    service._on_publisher_notice(["gone"])  # from its notice thread
    service._drain_inbox(block=False)
    assert released == [True] and started == [True] and not service.active  # the dead one's pipes closed
    assert [(e.reply_to, e.error.request_id, e.error.status) for e in sent] == [("gw1", "running", 503)]
