"""A Generation turning engine deltas into choice updates: hidden EOS, usage, stop strings, aborts."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from transformers import AutoTokenizer

from pagedserve.services.gateway.detokenizer import ChoiceText
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import ChoiceUpdate, Frontend, Generation
from pagedserve.services.gateway.registry import ModelEntry
from pagedserve.services.gateway.router import Delta, Disconnected, ResponseRouter
from pagedserve.services.gateway.token_text import TokenTexts
from pagedserve.shared.config import Config
from pagedserve.shared.protocol import (
    Accepted,
    CompletionRequest,
    EngineHeartbeat,
    RequestError,
    TokenizerHeartbeat,
)
from pagedserve.shared.redis_server import free_port


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


class Recorder:
    def __init__(self) -> None:
        self.aborts: list[tuple[str, list[int] | None]] = []

    async def __call__(self, model: str, request_id: str, choice_indexes: list[int] | None = None) -> None:
        self.aborts.append((request_id, choice_indexes))


def make_generation(tokenizer: Any, n: int, stop: list[str], can_abort_choices: bool) -> tuple[Generation, Recorder]:
    frontend = Frontend(Config.of(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    beat = EngineHeartbeat("e1", "m", 2048, supports_choice_abort=can_abort_choices)
    # served: an engine and a tokenizer service (else the frontend re-reads Redis before answering)
    frontend.registry.models["m"] = ModelEntry("m", engines=[beat], tokenizers=[TokenizerHeartbeat("t", "m", 0.0)])
    recorder = Recorder()
    frontend.abort = recorder  # type: ignore[method-assign]
    queue = frontend.router.register("r1")
    frontend.num_in_flight += 1
    prompt = tokenizer.encode("Hi")
    choices = [ChoiceText(tokenizer, prompt, stop) for _ in range(n)]
    accepted = Accepted("r1", len(prompt), 16, prompt)
    gen = Generation(frontend, "r1", "m", accepted, queue, choices, TokenTexts(tokenizer))
    return gen, recorder


def delta(index: int, ids: list[int], finish: str | None = None, logprobs: Any = None) -> Delta:
    return Delta(index, ids, logprobs, finish, 2, len(ids), 0, "e1")


async def run(gen: Generation, replies: list[Any]) -> list[ChoiceUpdate]:
    for reply in replies:
        gen.queue.put_nowait(reply)
    updates = [u async for u in gen.updates()]
    await asyncio.sleep(0)  # let spawned abort tasks run
    return updates


def test_eos_is_counted_not_shown_and_the_slot_is_released(tokenizer: Any) -> None:
    gen, recorder = make_generation(tokenizer, 1, [], False)
    words = tokenizer.encode(" Paris is nice")
    updates = asyncio.run(run(gen, [delta(0, words[:1]), delta(0, [*words[1:], tokenizer.eos_token_id], "stop")]))
    assert "".join(u.text for u in updates) == " Paris is nice"
    assert updates[-1].finish_reason == "stop" and gen.finish_reasons == {0: "stop"}
    assert gen.usage()["completion_tokens"] == len(words) + 1
    assert gen.frontend.num_in_flight == 0 and recorder.aborts == []  # the engine finished it: no abort


@pytest.mark.parametrize("can_abort_choices", [True, False])
def test_stop_string_in_one_choice_aborts_only_that_choice_where_engines_can(
    tokenizer: Any, can_abort_choices: bool
) -> None:
    gen, recorder = make_generation(tokenizer, 2, [" is"], can_abort_choices)
    ids, other_ids = tokenizer.encode(" Paris is nice"), tokenizer.encode(" London was nice")

    async def scenario() -> list[ChoiceUpdate]:
        updates = gen.updates()
        gen.queue.put_nowait(delta(0, ids))  # choice 0 hits the stop string, choice 1 goes on
        first = await anext(updates)
        await asyncio.sleep(0)
        assert recorder.aborts == ([("r1", [0])] if can_abort_choices else [])
        gen.queue.put_nowait(delta(0, ids[:1]))  # late tokens of the stopped choice are dropped
        gen.queue.put_nowait(delta(1, other_ids, "length"))
        rest = [u async for u in updates]
        await asyncio.sleep(0)  # let the final abort task run
        return [first, *rest]

    updates = asyncio.run(scenario())
    assert [(u.index, u.text, u.finish_reason) for u in updates] == [
        (0, " Paris", "stop"),
        (1, " London was nice", "length"),
    ]
    # Choice 0 never finished at the engine: the whole request is aborted when the generation ends.
    assert recorder.aborts[-1] == ("r1", None)


def test_errors_end_the_generation_with_the_tokenizers_status(tokenizer: Any) -> None:
    gen, recorder = make_generation(tokenizer, 1, [], False)
    with pytest.raises(APIError) as err:
        asyncio.run(run(gen, [delta(0, [5]), RequestError("r1", 400, "bad", param="logit_bias")]))
    assert (err.value.status, err.value.param) == (400, "logit_bias")
    assert gen.frontend.num_in_flight == 0 and recorder.aborts == [("r1", None)]


def test_a_redis_down_error_names_no_host_port_or_exception_text(tokenizer: Any) -> None:
    gen, recorder = make_generation(tokenizer, 1, [], False)  # its Redis URL points at a closed port
    frontend = gen.frontend
    port = str(frontend.redis.connection_pool.connection_kwargs["port"])

    async def tokenizer_of(model: str, source: str | None) -> tuple[Any, TokenTexts]:
        return tokenizer, TokenTexts(tokenizer)

    frontend.tokenizers.get = tokenizer_of  # type: ignore[method-assign]
    request = CompletionRequest("r2", "gw", "m", "Hello", max_tokens=4)

    async def submit() -> APIError:
        publisher = asyncio.create_task(frontend.publisher.run())  # what sends the XADDs
        try:
            with pytest.raises(APIError) as info:
                await asyncio.wait_for(frontend.submit(request, [], 1), 10)
            await asyncio.sleep(0.1)  # the abort of the given-up request runs (and fails quietly: Redis is down)
        finally:
            publisher.cancel()
        return info.value

    error = asyncio.run(submit())
    message = error.body()["error"]["message"]
    assert error.status == 503 and error.retry_after is not None
    assert "Redis" in message and "retry" in message
    for leak in ("127.0.0.1", "localhost", port, "Error 111", "Connection refused"):
        assert leak not in message
    assert frontend.num_in_flight == 1 and "r2" not in frontend.router.queues  # only make_generation's r1 left
    assert recorder.aborts == [("r2", None)]  # in case the XADD reached Redis after all


@pytest.mark.parametrize("ending", ["accept_timeout", "client_leaves"])
def test_a_request_given_up_before_acceptance_is_aborted(tokenizer: Any, ending: str) -> None:
    gen, recorder = make_generation(tokenizer, 1, [], False)
    frontend = gen.frontend
    frontend.settings.accept_timeout_s = 0.2  # no tokenizer answers in this test

    async def tokenizer_of(model: str, source: str | None) -> tuple[Any, TokenTexts]:
        return tokenizer, TokenTexts(tokenizer)

    async def published(stream: str, msg: Any, maxlen: int = 0) -> bytes:
        return b"0-1"

    frontend.tokenizers.get = tokenizer_of  # type: ignore[method-assign]
    frontend.publisher.publish = published  # type: ignore[method-assign]
    request = CompletionRequest("r3", "gw", "m", "Hello", max_tokens=4)

    async def give_up() -> None:
        submit = asyncio.create_task(frontend.submit(request, [], 1))
        if ending == "client_leaves":
            await asyncio.sleep(0.05)
            submit.cancel()
        with contextlib.suppress(APIError, asyncio.CancelledError):
            await submit
        await asyncio.sleep(0)  # the spawned abort runs

    asyncio.run(give_up())
    assert recorder.aborts == [("r3", None)]  # a tokenizer or engine that has it drops it
    assert frontend.num_in_flight == 1 and "r3" not in frontend.router.queues  # r3's slot freed


def counted(index: int, ids: list[int], count: int, finish: str | None = None) -> Delta:
    """A delta as engines send it: `count` is the choice's output tokens so far, these included."""
    return Delta(index, ids, None, finish, 2, count, 0, "e1")


def test_a_delta_sent_again_after_a_redis_outage_is_dropped(tokenizer: Any) -> None:
    gen, _ = make_generation(tokenizer, 1, [], False)
    words = tokenizer.encode(" Paris is nice")
    replies = [
        counted(0, words[:1], 1),
        Disconnected("redis went away", final=False),  # the stream stays open
        counted(0, words[:1], 1),  # re-sent: the engine held it and could not know it had arrived
        counted(0, words[1:], len(words), "length"),
    ]
    updates = asyncio.run(run(gen, replies))
    assert "".join(u.text for u in updates) == " Paris is nice" and gen.finish_reasons == {0: "length"}


def test_tokens_lost_in_a_redis_outage_make_the_request_continue_from_what_the_client_has(tokenizer: Any) -> None:
    gen, _ = make_generation(tokenizer, 1, [], False)
    words = tokenizer.encode(" Paris is nice and old")
    gen.queue.put_nowait(counted(0, words[:1], 1))
    gen.queue.put_nowait(Disconnected("redis went away", final=False))
    gen.queue.put_nowait(counted(0, words[3:], len(words)))  # tokens 2 and 3 died with Redis

    async def scenario() -> str:
        moved: list[str] = []

        async def move(g: Generation, old_id: str) -> None:
            moved.append(old_id)
            g.queue.put_nowait(Delta(0, words[1:], None, "length", 2, len(words), 0, "e2"))  # the continuation

        gen.frontend.move = move  # type: ignore[method-assign,assignment]
        gen.frontend.registry.up_since -= 60  # Redis has been back long enough
        gen.frontend.registry.is_redis_up = True
        text = "".join([u.text async for u in gen.updates()])
        assert moved == ["r1"] and gen.current_id == "r1.r1"
        return text

    assert asyncio.run(scenario()) == " Paris is nice and old"  # no hole, nothing twice


def test_an_outage_past_the_grace_ends_the_streams_in_flight() -> None:
    async def scenario() -> list[Any]:
        router = ResponseRouter(aioredis.Redis(port=free_port(), socket_connect_timeout=0.1), "gw", 0.3)
        queue = router.register("r1")
        task = asyncio.create_task(router.run())
        seen = [await asyncio.wait_for(queue.get(), 10), await asyncio.wait_for(queue.get(), 10)]
        task.cancel()
        return seen

    first, second = asyncio.run(scenario())
    assert isinstance(first, Disconnected) and not first.final  # the stream waits for Redis
    assert isinstance(second, Disconnected) and second.final  # the grace is over: it ends with an error


def test_next_reply_takes_a_queued_reply_at_once_and_times_out_on_an_empty_queue() -> None:
    """The per-token wait (frontend._next_reply): what is queued comes back in order without waiting; an empty
    queue raises TimeoutError after its timeout, and a reply that arrives meanwhile is returned."""
    from pagedserve.services.gateway.frontend import _next_reply

    async def run() -> None:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        queue.put_nowait("a")
        queue.put_nowait("b")
        assert [await _next_reply(queue, 0.0), await _next_reply(queue, 0.0)] == ["a", "b"]
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await _next_reply(queue, 0.05)
        assert loop.time() - start >= 0.04
        loop.call_later(0.01, queue.put_nowait, "c")
        assert await _next_reply(queue, 5.0) == "c"

    asyncio.run(run())
