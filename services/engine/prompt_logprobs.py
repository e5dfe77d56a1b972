"""Prompt logprobs: the log-probability of every prompt token given the tokens before it.

Only requests whose `SamplingParams.prompt_logprobs` is set pay for this: the runner normally keeps
the hidden state of each sequence's last row only. For those requests it takes every row of the
step's chunk (chunked prefill gives the prompt in pieces; each piece is handled on its own step)
and projects them to the vocabulary in slices, so a long prompt never needs one [len, vocab]
tensor. The row at position p predicts token p + 1; prompt token 0 has no logprob (None).

Such requests skip prefix-cache hits (the scheduler's rule): cached positions are never computed,
so their logits would be missing. A preempted request recomputes its prompt; `accumulate` keeps the
first value of each position, so nothing is sent twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.outputs import TokenLogprob
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampler import gather_logprobs
from pagedserve.services.engine.scheduler import ScheduledRequest

_ROWS_PER_SLICE = 256  # rows projected to the vocabulary at once (memory: rows x vocab x 4 bytes)


@dataclass(slots=True)
class PromptLogprobChunk:
    request: Request
    first_position: int  # prompt position of the first row's token (>= 1)
    token_ids: torch.Tensor  # [rows, 1 + k] int64: the prompt token, then the top k
    logprobs: torch.Tensor  # [rows, 1 + k] float32


def wants_prompt_logprobs(scheduled: Sequence[ScheduledRequest]) -> bool:
    return any(s.request.params.prompt_logprobs is not None for s in scheduled)


def compute_chunks(
    model: CausalLM, hidden: torch.Tensor, scheduled: Sequence[ScheduledRequest]
) -> list[PromptLogprobChunk]:
    """Device tensors of the prompt logprobs this step computed (hidden rows in schedule order)."""
    chunks = []
    row = 0
    for item in scheduled:
        request, k = item.request, item.request.params.prompt_logprobs
        first = item.num_computed_tokens + 1  # the first token this chunk's rows predict
        last = min(item.num_computed_tokens + item.num_new_tokens, request.num_prompt_tokens - 1)
        if k is not None and last >= first:
            rows = hidden[row : row + last - first + 1]
            targets = torch.tensor(request.prompt_token_ids[first : last + 1], dtype=torch.long, device=hidden.device)
            ids, values = [], []
            for start in range(0, rows.shape[0], _ROWS_PER_SLICE):
                logits = model.compute_logits(rows[start : start + _ROWS_PER_SLICE]).float()
                slice_ids, slice_values = gather_logprobs(
                    torch.log_softmax(logits, dim=-1), targets[start : start + _ROWS_PER_SLICE], k
                )
                ids.append(slice_ids)
                values.append(slice_values)
            chunks.append(PromptLogprobChunk(request, first, torch.cat(ids), torch.cat(values)))
        row += item.num_new_tokens
    return chunks


@dataclass(slots=True)
class PromptLogprobs:
    """A chunk on the host: one TokenLogprob per prompt position from `first_position` on."""

    request: Request
    first_position: int
    entries: list[TokenLogprob]


def to_host(chunks: Sequence[PromptLogprobChunk]) -> list[PromptLogprobs]:
    result = []
    for chunk in chunks:
        entries = [
            TokenLogprob(int(ids[0]), values[0], [(int(t), v) for t, v in zip(ids[1:], values[1:])])
            for ids, values in zip(chunk.token_ids.tolist(), chunk.logprobs.tolist())
        ]
        result.append(PromptLogprobs(chunk.request, chunk.first_position, entries))
    return result


def accumulate(collected: list[TokenLogprob | None], part: PromptLogprobs) -> None:
    """Append a chunk's entries to a request's list ([None] for token 0 first), each position once."""
    if not collected:
        collected.append(None)
    for offset, entry in enumerate(part.entries):
        if part.first_position + offset == len(collected):
            collected.append(entry)
