"""Batched prompts: one Generation per prompt merged into one view (choices renumbered i * n + j, usage
summed), and all-or-none submission (the accepted prompts of a refused or cancelled batch are released)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pagedserve.services.gateway.batch import BatchGeneration, parts_of, submit_batch
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import ChoiceUpdate, Frontend, Generation
from pagedserve.shared.protocol import CompletionRequest, RequestError
from pagedserve.shared.tokenizer_loader import load_tokenizer
from tests.gateway.gateway_helpers import AbortRecorder, ScriptedSubmit, delta, offline_frontend, open_generation


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.fixture()
def frontend() -> tuple[Frontend, AbortRecorder]:
    return offline_frontend()


def words(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_choices_finish_reasons_and_usage_of_the_parts_are_merged(
    tokenizer: Any, frontend: tuple[Frontend, AbortRecorder]
) -> None:
    fe, _ = frontend
    parts = [open_generation(fe, tokenizer, f"b-{i}", words(tokenizer, p), n=2) for i, p in enumerate(["A b", "C"])]
    parts[0].finish_reasons.update({0: "stop", 1: "length"})
    parts[1].finish_reasons.update({1: "stop"})
    parts[0].num_cached_tokens, parts[1].num_cached_tokens = 2, 1
    parts[0].choices[1].token_ids.extend([5, 6, 7])
    parts[1].choices[0].token_ids.append(8)
    batch = BatchGeneration("b", parts, n=2)
    assert (batch.model, batch.created, batch.token_texts) == (parts[0].model, parts[0].created, parts[0].token_texts)
    assert batch.choices == [*parts[0].choices, *parts[1].choices]
    assert batch.finish_reasons == {0: "stop", 1: "length", 3: "stop"}
    assert batch.usage() == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert parts_of(batch) == parts and parts_of(parts[1]) == [parts[1]]


def test_updates_come_as_they_arrive_renumbered_until_every_part_ends(
    tokenizer: Any, frontend: tuple[Frontend, AbortRecorder]
) -> None:
    fe, recorder = frontend
    parts = [open_generation(fe, tokenizer, f"b-{i}", words(tokenizer, "Hi"), n=2) for i in range(2)]
    batch = BatchGeneration("b", parts, n=2)
    one, two = words(tokenizer, " one"), words(tokenizer, " two")

    async def scenario() -> list[ChoiceUpdate]:
        seen = []
        updates = batch.updates()
        parts[1].queue.put_nowait(delta(1, one))
        seen.append(await anext(updates))  # the second prompt's update comes first: nothing waits on prompt 0
        for part in parts:
            for index in range(2):
                part.queue.put_nowait(delta(index, two, "length", count=len(two) + (len(one) if index else 0)))
        seen += [u async for u in updates]
        return seen

    seen = asyncio.run(scenario())
    assert (seen[0].index, seen[0].text) == (3, " one")
    assert sorted((u.index, u.text, u.finish_reason) for u in seen[1:]) == [
        (0, " two", "length"),
        (1, " two", "length"),
        (2, " two", "length"),
        (3, " two", "length"),
    ]
    assert batch.finish_reasons == dict.fromkeys(range(4), "length")
    assert recorder.aborts == [] and fe.num_in_flight == 0  # every part ended at the engine: nothing to abort


def test_the_first_error_ends_the_batch_and_aborts_every_other_part(
    tokenizer: Any, frontend: tuple[Frontend, AbortRecorder]
) -> None:
    fe, recorder = frontend
    parts = [open_generation(fe, tokenizer, f"b-{i}", words(tokenizer, "Hi")) for i in range(3)]
    batch = BatchGeneration("b", parts, n=1)
    parts[0].queue.put_nowait(delta(0, words(tokenizer, " done"), "length"))
    parts[2].queue.put_nowait(RequestError("b-2", 400, "prompt too long", param="prompt"))

    async def scenario() -> list[ChoiceUpdate]:
        seen: list[ChoiceUpdate] = []
        with pytest.raises(APIError) as error:
            async for update in batch.updates():
                seen.append(update)
        assert (error.value.status, error.value.param) == (400, "prompt")
        return seen

    seen = asyncio.run(scenario())
    assert [u.index for u in seen] in ([], [0])  # prompt 0's update may come before the error
    # Part 0 finished at the engine; part 1 (still waiting) and part 2 (failed) are released and aborted.
    assert recorder.aborted_ids == {"b-1", "b-2"}
    assert all(part.released for part in parts) and fe.num_in_flight == 0


def requests(*prompts: str) -> list[CompletionRequest]:
    return [CompletionRequest(f"b-{i}", "gw", "m", prompt) for i, prompt in enumerate(prompts)]


def test_submit_batch_keeps_the_prompts_in_order(tokenizer: Any, frontend: tuple[Frontend, AbortRecorder]) -> None:
    fe, recorder = frontend
    order = ["First", "Second", "Third"]
    script = ScriptedSubmit(fe, tokenizer, lambda prompt, index: f" {order.index(prompt)}.{index}")
    fe.submit = script  # type: ignore[method-assign]

    async def scenario() -> tuple[BatchGeneration, list[ChoiceUpdate]]:
        batch = await submit_batch(fe, requests("First", "Second", "Third"), [], 2, "b")
        return batch, [u async for u in batch.updates()]

    batch, updates = asyncio.run(scenario())
    assert batch.request_id == "b" and batch.n == 2
    assert [p.request_id for p in batch.parts] == ["b-0", "b-1", "b-2"]
    assert [tokenizer.decode(p.accepted.prompt_token_ids) for p in batch.parts] == ["First", "Second", "Third"]
    assert sorted((u.index, u.text) for u in updates) == [(i, f" {i // 2}.{i % 2}") for i in range(6)]
    assert recorder.aborts == [] and fe.num_in_flight == 0


def test_a_refused_prompt_releases_every_accepted_one(tokenizer: Any, frontend: tuple[Frontend, AbortRecorder]) -> None:
    fe, recorder = frontend
    script = ScriptedSubmit(
        fe, tokenizer, lambda prompt, index: " ok", refuse={"Second": APIError(429, "too many", retry_after=1)}
    )
    fe.submit = script  # type: ignore[method-assign]
    with pytest.raises(APIError) as error:
        asyncio.run(submit_batch(fe, requests("First", "Second", "Third"), [], 1, "b"))
    assert error.value.status == 429
    assert recorder.aborted_ids == {"b-0", "b-2"} and all(g.released for g in script.generations)
    assert fe.num_in_flight == 0 and fe.router.queues == {}


def test_a_batch_cancelled_while_submitting_releases_what_was_accepted(
    tokenizer: Any, frontend: tuple[Frontend, AbortRecorder]
) -> None:
    fe, recorder = frontend
    accepted: list[Generation] = []
    never = asyncio.Event()

    async def submit(req: CompletionRequest, stop: list[str], n: int, text: Any = None) -> Generation:
        if req.prompt == "slow":
            await never.wait()  # an acceptance that never comes (the tokenizer is busy)
        gen = open_generation(fe, tokenizer, req.request_id, words(tokenizer, str(req.prompt)))
        accepted.append(gen)
        return gen

    fe.submit = submit  # type: ignore[method-assign,assignment]

    async def scenario() -> None:
        task = asyncio.create_task(submit_batch(fe, requests("fast", "slow"), [], 1, "b"))
        while not accepted:
            await asyncio.sleep(0)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert [g.request_id for g in accepted] == ["b-0"] and accepted[0].released
    assert recorder.aborted_ids == {"b-0"} and fe.num_in_flight == 0
