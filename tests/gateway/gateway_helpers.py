"""A real Frontend whose requests never leave the process (no Redis, no tokenizer or engine service).

`offline_frontend` points at a closed Redis port and records aborts instead of sending them;
`open_generation` is an accepted request as `Frontend.submit` leaves it (in flight, its router queue
registered); `ScriptedSubmit` stands in for `Frontend.submit`, answering every choice of every request
at once, as an engine would over several steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from pagedserve.services.gateway.detokenizer import ChoiceText, TextOptions
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.frontend import Frontend, Generation
from pagedserve.services.gateway.router import Delta
from pagedserve.services.gateway.token_text import TokenTexts
from pagedserve.shared.config import Config
from pagedserve.shared.prompts import text_prompt_ids
from pagedserve.shared.protocol import Accepted, ChatRequest, CompletionRequest
from pagedserve.shared.redis_server import free_port


class AbortRecorder:
    """Replaces `Frontend.abort`: records each abort when it is spawned (synchronously), sends nothing."""

    def __init__(self) -> None:
        self.aborts: list[tuple[str, list[int] | None]] = []

    def __call__(
        self, model: str, request_id: str, choice_indexes: list[int] | None = None
    ) -> Coroutine[Any, Any, None]:
        self.aborts.append((request_id, choice_indexes))
        return asyncio.sleep(0)

    @property
    def aborted_ids(self) -> set[str]:
        return {request_id for request_id, _ in self.aborts}


def offline_config(**flat: Any) -> Config:
    return Config.of(redis_url=f"redis://127.0.0.1:{free_port()}/0", **flat)


def offline_frontend(frontend: Frontend | None = None, **flat: Any) -> tuple[Frontend, AbortRecorder]:
    frontend = frontend or Frontend(offline_config(**flat))
    recorder = AbortRecorder()
    frontend.abort = recorder  # type: ignore[method-assign]
    return frontend, recorder


def open_generation(
    frontend: Frontend,
    tokenizer: Any,
    request_id: str,
    prompt_ids: list[int],
    n: int = 1,
    stop: Sequence[str] = (),
    model: str = "m",
) -> Generation:
    queue = frontend.router.register(request_id)
    frontend.num_in_flight += 1
    choices = [ChoiceText(tokenizer, prompt_ids, list(stop)) for _ in range(n)]
    accepted = Accepted(request_id, len(prompt_ids), 16, list(prompt_ids))
    return Generation(frontend, request_id, model, accepted, queue, choices, TokenTexts(tokenizer))


def delta(
    index: int,
    ids: list[int],
    finish: str | None = None,
    count: int | None = None,
    logprobs: list[Any] | None = None,
    prompt_logprobs: list[Any] | None = None,
    cached: int = 0,
) -> Delta:
    """A delta as an engine sends it (`count`: the choice's output tokens so far, these included)."""
    return Delta(index, ids, logprobs, finish, 0, len(ids) if count is None else count, cached, "e1", prompt_logprobs)


def fake_logprob(token_id: int) -> float:
    return -(token_id % 7) - 0.5


def fake_prompt_logprobs(prompt_ids: list[int]) -> list[Any]:
    """What an engine sends for prompt_logprobs: none for the first token, then [logprob, top [[id, lp]]]."""
    return [None] + [[fake_logprob(t), [[t, fake_logprob(t)], [7, -9.0]]] for t in prompt_ids[1:]]


class ScriptedSubmit:
    """Stands in for `Frontend.submit`: accepts each request with the prompt tokenized, then queues the whole
    answer of each choice, `answer(prompt text, choice index)`, finishing with "length" (with logprobs and
    prompt logprobs when the request asked). A prompt in `refuse` gets that error instead."""

    def __init__(
        self,
        frontend: Frontend,
        tokenizer: Any,
        answer: Callable[[str, int], str],
        refuse: dict[str, APIError] | None = None,
    ) -> None:
        self.frontend, self.tokenizer, self.answer = frontend, tokenizer, answer
        self.refuse = refuse or {}
        self.requests: list[ChatRequest | CompletionRequest] = []
        self.generations: list[Generation] = []

    async def __call__(
        self, req: ChatRequest | CompletionRequest, stop: list[str], n: int, text: TextOptions | None = None
    ) -> Generation:
        self.requests.append(req)
        assert isinstance(req, CompletionRequest), "scripted for completions"
        prompt_ids = text_prompt_ids(self.tokenizer, req.prompt)
        prompt_text = req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(req.prompt)
        if prompt_text in self.refuse:
            raise self.refuse[prompt_text]
        await asyncio.sleep(0)  # as a real submit does: the others of a batch are submitted meanwhile
        gen = open_generation(self.frontend, self.tokenizer, req.request_id, prompt_ids, n, stop, req.model)
        wants_logprobs = req.sampling.get("logprobs") is not None
        wants_prompt_logprobs = req.sampling.get("prompt_logprobs") is not None
        for index in range(n):
            ids = self.tokenizer.encode(self.answer(prompt_text, index), add_special_tokens=False)
            gen.queue.put_nowait(
                delta(
                    index,
                    ids,
                    "length",
                    logprobs=[[fake_logprob(t), [[t, fake_logprob(t)]]] for t in ids] if wants_logprobs else None,
                    prompt_logprobs=fake_prompt_logprobs(prompt_ids) if wants_prompt_logprobs else None,
                )
            )
        self.generations.append(gen)
        return gen
