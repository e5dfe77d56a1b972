"""Moving a request whose engine died: the continuation carries what each choice already streamed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Generation
from pagedserve.services.gateway.router import Disconnected
from pagedserve.shared import streams
from pagedserve.shared.protocol import GenerateRequest
from pagedserve.shared.publisher import Publisher
from tests.gateway.test_generation import delta, make_generation


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture()
def published(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    sent: list[tuple[str, Any]] = []

    async def publish(self: Publisher, stream: str, msg: Any, maxlen: int = 0) -> bytes:
        sent.append((stream, msg))
        return b"0-1"

    monkeypatch.setattr(Publisher, "publish", publish)
    return sent


def migrate(gen: Generation) -> None:
    asyncio.run(gen._migrate("engine e1 is gone"))  # what updates() does once the engine's heartbeat is gone


def can_continue_choices(gen: Generation, is_supported: bool) -> None:
    for beat in gen.frontend.registry.models["m"].engines:
        beat.supports_choice_continuation = is_supported


def test_each_running_choice_moves_with_its_tokens_and_index(tokenizer: Any, published: list) -> None:
    gen, recorder = make_generation(tokenizer, 3, [], False)
    can_continue_choices(gen, True)
    words = tokenizer.encode(" one two three four five six")
    gen._apply(delta(0, words[:2]))
    gen._apply(delta(1, words[:3], "length"))  # finished on the dead engine: not resumed
    gen._apply(delta(2, words[:1]))
    migrate(gen)

    [(stream, request)] = published
    assert stream == streams.generate_stream("m") and isinstance(request, GenerateRequest)
    assert request.request_id == gen.current_id == "r1.r1" and request.sampling["max_tokens"] == 16
    assert request.choice_indexes == [0, 2] and request.output_token_ids == []
    assert request.choice_output_token_ids == [words[:2], words[:1]]
    assert recorder.aborts == [("r1", None)]  # the old id, so a replica claiming it later drops it
    assert "r1" not in gen.frontend.router.queues and gen.frontend.router.queues["r1.r1"] is gen.queue

    async def finish() -> str:  # the new replica's tokens continue each choice under its own index
        gen.queue.put_nowait(delta(2, words[1:3], "length"))
        gen.queue.put_nowait(delta(0, words[2:4], "length"))
        return "|".join(u.text for u in [u async for u in gen.updates()])

    asyncio.run(finish())
    assert [c.token_ids for c in gen.choices] == [words[:4], words[:3], words[:3]]
    assert [c.text for c in gen.choices] == [tokenizer.decode(c.token_ids) for c in gen.choices]
    assert gen.usage()["completion_tokens"] == 10


def test_a_single_choice_moves_as_output_token_ids(tokenizer: Any, published: list) -> None:
    gen, _ = make_generation(tokenizer, 1, [], False)
    words = tokenizer.encode(" one two")
    gen._apply(delta(0, words))
    migrate(gen)
    [(_, request)] = published
    assert request.output_token_ids == words and request.choice_indexes == []


def test_engines_that_cannot_continue_choices_end_an_n_choice_request(tokenizer: Any, published: list) -> None:
    gen, _ = make_generation(tokenizer, 2, [], False)
    can_continue_choices(gen, False)  # an older engine would restart both choices from their first token
    gen._apply(delta(0, tokenizer.encode(" one")))
    with pytest.raises(APIError) as info:
        migrate(gen)
    assert info.value.status == 503 and info.value.code == "engine_lost" and published == []


@pytest.mark.parametrize("ending", ["finish", "client_leaves", "error"])
def test_a_migrated_request_is_released_once_under_every_id(tokenizer: Any, published: list, ending: str) -> None:
    gen, recorder = make_generation(tokenizer, 1, [], False)
    words = tokenizer.encode(" one two three")
    gen._apply(delta(0, words[:1]))
    migrate(gen)
    migrate(gen)  # moved twice: three ids
    frontend = gen.frontend

    async def end() -> None:
        if ending == "finish":
            gen.queue.put_nowait(delta(0, words[1:], "length"))
        elif ending == "error":
            gen.queue.put_nowait(Disconnected("lost the request queue"))
        updates = gen.updates()
        if ending == "client_leaves":  # the client goes away after one more token
            gen.queue.put_nowait(delta(0, words[1:2]))
            await anext(updates)
            await updates.aclose()
        else:
            with contextlib.suppress(APIError):
                _ = [u async for u in updates]
        frontend.release(gen)  # a second caller (the response's own end): a no-op
        await asyncio.sleep(0)  # let the spawned abort run

    asyncio.run(end())
    assert frontend.num_in_flight == 0 and gen.released
    assert not frontend.router.queues  # r1, r1.r1 and r1.r2 all unregistered
    final_aborts = [a for a in recorder.aborts if a[0] == "r1.r2"]
    assert final_aborts == ([] if ending == "finish" else [("r1.r2", None)])  # unfinished work aborted, once


def test_tokens_of_a_replica_that_claimed_the_request_from_scratch_are_dropped(tokenizer: Any, published: list) -> None:
    gen, _ = make_generation(tokenizer, 1, [], False)
    words = tokenizer.encode(" one two three")
    gen._apply(delta(0, words[:2]))  # streaming on e1
    restarted = dataclasses.replace(delta(0, words[:1]), engine_id="e2")  # e2 claimed e1's entry: from token 0
    assert gen._apply(restarted) is None
    assert gen.choices[0].token_ids == words[:2] and gen.engine_id == "e1"  # the move continues it instead
    migrate(gen)
    assert gen._apply(dataclasses.replace(delta(0, words[2:3]), engine_id="e2")) is not None  # the continuation
    assert gen.choices[0].token_ids == words[:3] and gen.engine_id == "e2"
