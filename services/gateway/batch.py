"""Batched completion prompts: one wire request per prompt, merged into one response.

Each prompt goes through the whole ordinary path (tokenizer, engine, detokenizer, migration,
aborts) as its own request; `BatchGeneration` merges their updates and renumbers the choices as
OpenAI does: prompt i, sample j -> index i * n + j. Usage is summed over the prompts.

If any prompt is refused (too long, a full queue), the others that were accepted are released
(aborted in the engine) and the error goes to the client before any byte of the response.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedserve.services.gateway.detokenizer import ChoiceText, TextOptions
from pagedserve.services.gateway.frontend import ChoiceUpdate, Frontend, Generation
from pagedserve.services.gateway.token_text import TokenTexts
from pagedserve.shared.protocol import CompletionRequest


class GenerationView(Protocol):
    """What response building reads of a generation: a single one, or a batch of them."""

    @property
    def request_id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def served_model(self) -> str: ...
    @property
    def created(self) -> int: ...
    @property
    def response_id(self) -> str: ...
    @property
    def choices(self) -> list[ChoiceText]: ...
    @property
    def token_texts(self) -> TokenTexts: ...
    @property
    def finish_reasons(self) -> dict[int, str]: ...

    def usage(self) -> dict[str, Any]: ...
    def updates(self) -> AsyncIterator[ChoiceUpdate]: ...


@dataclass(slots=True)
class BatchGeneration:
    request_id: str
    parts: list[Generation]  # one per prompt, in order
    n: int  # choices per prompt
    created: int = field(init=False)
    response_id: str = ""  # the id clients see, when the request named one

    def __post_init__(self) -> None:
        self.created = self.parts[0].created

    @property
    def model(self) -> str:
        return self.parts[0].model

    @property
    def served_model(self) -> str:
        return self.parts[0].served_model

    @property
    def token_texts(self) -> TokenTexts:
        return self.parts[0].token_texts

    @property
    def choices(self) -> list[ChoiceText]:
        return [choice for part in self.parts for choice in part.choices]

    @property
    def finish_reasons(self) -> dict[int, str]:
        return {i * self.n + j: r for i, part in enumerate(self.parts) for j, r in part.finish_reasons.items()}

    def usage(self) -> dict[str, Any]:
        usages = [part.usage() for part in self.parts]
        total = {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        return {**total, "prompt_tokens_details": {"cached_tokens": cached}}

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Every part's updates as they come, renumbered; the first error ends (and aborts) all."""
        queue: asyncio.Queue[ChoiceUpdate | Exception | None] = asyncio.Queue()

        async def pump(prompt_index: int, part: Generation) -> None:
            try:
                async for update in part.updates():
                    queue.put_nowait(dataclasses.replace(update, index=prompt_index * self.n + update.index))
            except Exception as exc:  # an APIError of one part is the batch's
                queue.put_nowait(exc)
            else:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, part)) for i, part in enumerate(self.parts)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:  # a failure or a client that went away: every part's own `finally` aborts it
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def submit_batch(
    frontend: Frontend,
    requests: Sequence[CompletionRequest],
    stop: list[str],
    n: int,
    batch_id: str,
    text: TextOptions | None = None,
) -> BatchGeneration:
    """Submit every prompt at once; all accepted, or none kept (also when the caller is cancelled)."""
    tasks = [asyncio.create_task(frontend.submit(r, stop, n, text)) for r in requests]
    try:
        await asyncio.wait(tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        _release_accepted(frontend, tasks)
        raise
    errors = [e for e in (t.exception() for t in tasks) if e is not None]
    if errors:
        _release_accepted(frontend, tasks)
        raise errors[0]
    return BatchGeneration(batch_id, [t.result() for t in tasks], n)


def _release_accepted(frontend: Frontend, tasks: list[asyncio.Task[Generation]]) -> None:
    for task in tasks:
        if not task.cancelled() and task.exception() is None:
            frontend.release(task.result())  # aborts it in the engine, frees its in-flight slot


def parts_of(gen: GenerationView) -> list[Generation]:
    """The per-prompt generations behind a view."""
    if isinstance(gen, BatchGeneration):
        return gen.parts
    assert isinstance(gen, Generation)
    return [gen]
