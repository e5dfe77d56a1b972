"""A Generation turning engine deltas into choice updates: hidden EOS, usage, stop strings, aborts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.gateway.detokenizer import ChoiceText
from services.gateway.errors import APIError
from services.gateway.frontend import ChoiceUpdate, Frontend, Generation
from services.gateway.registry import ModelEntry
from services.gateway.router import Delta
from services.gateway.token_text import TokenTexts
from shared.protocol import Accepted, EngineHeartbeat, RequestError
from shared.redis_server import free_port
from shared.settings import GatewaySettings


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


class Recorder:
    def __init__(self) -> None:
        self.aborts: list[tuple[str, list[int] | None]] = []

    async def __call__(self, model: str, request_id: str, choice_indexes: list[int] | None = None) -> None:
        self.aborts.append((request_id, choice_indexes))


def make_generation(tokenizer: Any, n: int, stop: list[str], can_abort_choices: bool) -> tuple[Generation, Recorder]:
    frontend = Frontend(GatewaySettings(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    beat = EngineHeartbeat("e1", "m", 2048, supports_choice_abort=can_abort_choices)
    frontend.registry.models["m"] = ModelEntry("m", engines=[beat])
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
        (0, " Paris", "stop"), (1, " London was nice", "length"),
    ]
    # Choice 0 never finished at the engine: the whole request is aborted when the generation ends.
    assert recorder.aborts[-1] == ("r1", None)


def test_errors_end_the_generation_with_the_tokenizers_status(tokenizer: Any) -> None:
    gen, recorder = make_generation(tokenizer, 1, [], False)
    with pytest.raises(APIError) as err:
        asyncio.run(run(gen, [delta(0, [5]), RequestError("r1", 400, "bad", param="logit_bias")]))
    assert (err.value.status, err.value.param) == (400, "logit_bias")
    assert gen.frontend.num_in_flight == 0 and recorder.aborts == [("r1", None)]
