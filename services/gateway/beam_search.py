"""Beam search (vLLM's `use_beam_search`), run by the gateway as vLLM's own frontend runs it.

    step 0: the request itself (chat template, checks, the resolved token budget) ─► first token's top 2w
    step k: one one-token completion per live beam (prompt + beam), sent together so engines batch them
            ─► each beam's top 2w raw logprobs ─► the w best extensions live on; one that picks EOS is done

Beams share their prompt's and each other's full KV blocks through prefix caching, so a step prefills
little more than each beam's last block. Scores are vLLM's: cumulative logprob / length ** length_penalty,
where the length counts the prompt and not a final EOS. The w best of the finished and the live beams are
the answer, best first.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.services.gateway.frontend import ChoiceUpdate, Frontend, Generation
from pagedserve.shared.protocol import ChatRequest, CompletionRequest, Sampling
from pagedserve.shared.stop_rule import find_stop_string

MAX_LOGPROBS = 20  # what an engine lists per token
MAX_WIDTH = MAX_LOGPROBS // 2  # each beam's 2 * width candidates come from one logprobs list


@dataclass(slots=True)
class Beam:
    tokens: list[int]  # the prompt's, then the output's
    cum_logprob: float = 0.0
    is_eos: bool = False  # ended by an EOS token
    logprobs: list[Any] = field(default_factory=list)  # per output token [logprob, [[id, logprob], ...]]


def score(beam: Beam, length_penalty: float) -> float:
    length = len(beam.tokens) - (1 if beam.is_eos else 0)
    return beam.cum_logprob / length**length_penalty


def extend(
    beams: list[Beam],
    candidates: list[list[list[Any]]],
    width: int,
    eos_ids: set[int],
    length_penalty: float,
    num_logprobs: int = 0,
) -> tuple[list[Beam], list[Beam]]:
    """(the `width` best live extensions, the extensions that picked EOS) of `beams`, given each beam's
    candidates [[token_id, logprob], ...]. `num_logprobs`: alternatives kept per token for the answer."""
    live: list[Beam] = []
    done: list[Beam] = []
    for beam, top in zip(beams, candidates):
        for token_id, logprob in top[: 2 * width]:
            entry = [logprob, top[:num_logprobs]]
            tokens, logprobs = [*beam.tokens, token_id], [*beam.logprobs, entry]
            new = Beam(tokens, beam.cum_logprob + logprob, token_id in eos_ids, logprobs)
            (done if new.is_eos else live).append(new)
    live.sort(key=lambda b: score(b, length_penalty), reverse=True)
    return live[:width], done


@dataclass(slots=True)
class BeamResult:
    num_prompt_tokens: int
    prompt_token_ids: list[int]
    beams: list[Beam]  # best first
    tokenizer: Any
    token_texts: Any

    def output_ids(self, beam: Beam) -> list[int]:
        return beam.tokens[self.num_prompt_tokens :]


async def search(
    frontend: Frontend,
    first: ChatRequest | CompletionRequest,
    width: int,
    length_penalty: float,
    num_logprobs: int | None,
) -> BeamResult:
    """Run the search for one prompt; APIErrors (the request's checks, a lost engine) propagate."""
    ignore_eos = bool(first.sampling.get("ignore_eos"))
    sampling = first.sampling.copy()  # each step: one greedy token and its candidates, nothing else
    for name in ("seed", "prompt_logprobs", "structured_output"):
        sampling.pop(name, None)  # type: ignore[misc]  # a literal of Sampling's optional keys
    sampling.update(Sampling(n=1, temperature=0.0, min_tokens=0, logprobs=max(2 * width, num_logprobs or 0)))
    first = replace(first, sampling=sampling, stream=False)
    gen = await frontend.submit(first, [], 1)
    top = await _first_top(gen)  # then aborted: only the first token's list is used
    tokenizer = gen.choices[0].tokenizer
    eos_ids = set() if ignore_eos else _eos_ids(tokenizer, sampling)
    prompt = list(gen.accepted.prompt_token_ids)
    keep = num_logprobs or 0
    live, done = extend([Beam(prompt)], [top], width, eos_ids, length_penalty, keep)
    for step in range(1, gen.accepted.max_tokens):
        if not live:
            break
        tops = await asyncio.gather(*(_next_top(frontend, first, beam, f"s{step}b{i}") for i, beam in enumerate(live)))
        live, more = extend(live, list(tops), width, eos_ids, length_penalty, keep)
        done += more
    best = sorted([*done, *live], key=lambda b: score(b, length_penalty), reverse=True)[:width]
    return BeamResult(len(prompt), prompt, best, tokenizer, gen.token_texts)


async def _first_top(gen: Generation) -> list[list[Any]]:
    updates = gen.updates()
    try:
        async for update in updates:
            if update.logprobs:
                return list(update.logprobs[0][1])
    finally:
        await updates.aclose()  # releases the request; an unfinished one is aborted
    raise RuntimeError("the engine sent no token")  # an engine always sends one before finishing


async def _next_top(
    frontend: Frontend, first: ChatRequest | CompletionRequest, beam: Beam, tag: str
) -> list[list[Any]]:
    req = CompletionRequest(
        request_id=f"{first.request_id}-{tag}",
        reply_to=first.reply_to,
        model=first.model,
        prompt=beam.tokens,
        sampling=first.sampling,
        max_tokens=1,
        arrival_time=time.time(),
        traceparent=first.traceparent,
    )
    return await _first_top(await frontend.submit(req, [], 1))


def _eos_ids(tokenizer: Any, sampling: Sampling) -> set[int]:
    """The tokenizer's EOS (vLLM's rule) and the request's stop_token_ids."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return {*([eos] if isinstance(eos, int) else []), *(sampling.get("stop_token_ids") or [])}


@dataclass(slots=True)
class BeamChoice:
    text: str
    token_ids: list[int]  # the output's, a final EOS included
    finish_reason: str  # "stop" (EOS, a stop token or string) or "length"
    stop_reason: str | int | None
    cum_logprob: float
    score: float
    update: ChoiceUpdate  # the whole choice as one update (for the logprobs builders)


def choices_of(
    result: BeamResult,
    n: int,
    stop: list[str],
    length_penalty: float,
    skip_special_tokens: bool = True,
    include_stop_str: bool = False,
) -> list[BeamChoice]:
    """The n best beams as answer choices: text decoded whole, cut at the first stop string."""
    choices: list[BeamChoice] = []
    for beam in result.beams[:n]:
        ids = result.output_ids(beam)
        shown = ids[:-1] if beam.is_eos else ids
        text = str(result.tokenizer.decode(shown, skip_special_tokens=skip_special_tokens))
        finish = "stop" if beam.is_eos else "length"
        reason: str | int | None = None
        if beam.is_eos and ids and ids[-1] != getattr(result.tokenizer, "eos_token_id", None):
            reason = ids[-1]
        cut = find_stop_string(text, stop)  # the gateway's rule: the earliest stop string
        if cut is not None:
            end = cut[0] + (len(cut[1]) if include_stop_str else 0)
            text, finish, reason = text[:end], "stop", cut[1]
        update = ChoiceUpdate(len(choices), text, ids, beam.logprobs, finish)
        choices.append(BeamChoice(text, ids, finish, reason, beam.cum_logprob, score(beam, length_penalty), update))
    return choices
