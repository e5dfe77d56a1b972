"""Pooling: a prompt's final hidden states (after the model's final norm) -> one embedding vector.

A pooling request runs its prompt's forward pass only: the scheduler never marks it as sampling and
ends it (KV blocks freed) in the step that computes its last prompt token. Chunked prefill gives the
prompt in pieces, so each step folds its chunk into the request's running state on the device:

    LAST  the last prompt token's row   (decoder embedding models: Qwen3-Embedding, e5-mistral)
    MEAN  the mean over every row       (a running sum, divided at the end)
    CLS   the first token's row         (position 0, in the first chunk)

then `dimensions` keeps the first d components (Matryoshka) and `normalize` scales to unit L2 norm.
MEAN and CLS need rows a prefix-cache hit would skip, so such requests skip the cache (scheduler);
a preempted request restarts at position 0 and its state with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.services.engine.pooling_config import PoolingParams
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.scheduler import ScheduledRequest


@dataclass(slots=True)
class PooledChunk:
    request: Request
    vector: torch.Tensor  # [dims] float32 on the device, final


def finish_vector(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Truncate to `dimensions` (Matryoshka), then scale to unit L2 norm when asked."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2, dim=-1)
    return vector


def wants_pooling(scheduled: Sequence[ScheduledRequest]) -> bool:
    return any(s.request.pooling is not None for s in scheduled)


def pool_step(hidden: torch.Tensor, scheduled: Sequence[ScheduledRequest]) -> list[PooledChunk]:
    """Fold this step's rows into each pooling request's state; the requests whose prompt ended this step get
    their final vector (hidden rows in schedule order, as the runner computed them)."""
    finished = []
    row = 0
    for item in scheduled:
        request, params = item.request, item.request.pooling
        num_rows = item.num_new_tokens
        if params is not None:
            rows = hidden[row : row + num_rows].float()  # [num_rows, hidden]
            if item.num_computed_tokens == 0:  # a new start (also after preemption)
                request.pooled_state = None
            if params.pooling_type == "MEAN":
                chunk_sum = rows.sum(dim=0)
                state = request.pooled_state
                request.pooled_state = chunk_sum if state is None else state + chunk_sum
            elif params.pooling_type == "CLS" and item.num_computed_tokens == 0:
                request.pooled_state = rows[0]
            is_last = item.num_computed_tokens + num_rows == request.num_tokens
            if is_last:
                vector = _final(request, rows, params)
                finished.append(PooledChunk(request, finish_vector(vector, params.dimensions, params.normalize)))
                request.pooled_state = None
        row += num_rows
    return finished


def _final(request: Request, rows: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    if params.pooling_type == "LAST":
        return rows[-1]
    state = request.pooled_state
    assert state is not None, "a MEAN/CLS request must have computed its prompt from position 0"
    return state / request.num_tokens if params.pooling_type == "MEAN" else state


def to_host(chunks: Sequence[PooledChunk]) -> list[tuple[Request, list[float]]]:
    """The step's vectors on the host, in one copy (their sizes may differ: `dimensions` is per request)."""
    if not chunks:
        return []
    values: list[float] = torch.cat([c.vector for c in chunks]).cpu().tolist()
    result, start = [], 0
    for chunk in chunks:
        size = chunk.vector.shape[0]
        result.append((chunk.request, values[start : start + size]))
        start += size
    return result
