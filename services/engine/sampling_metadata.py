"""Per-step sampling tensors built from the sequences that sample (one row each).

Everything the sampler needs is gathered here with small per-request loops over Python lists, so
that the sampler itself is pure batched tensor code. Optional features are None when no row in
the step uses them, so the common case (plain temperature sampling or greedy) costs nothing extra.
On CUDA the lists travel through pinned memory with asynchronous copies: a plain `torch.tensor(...,
device="cuda")` would wait for the GPU to finish the step in flight, undoing the CPU/GPU overlap.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.services.engine.request import Request


@dataclass(slots=True)
class SparseRows:
    """(row, token id, value) triples: a few entries of a [num_rows, vocab] matrix."""

    row_ids: torch.Tensor  # [num_entries] int64
    token_ids: torch.Tensor  # [num_entries] int64
    values: torch.Tensor  # [num_entries] float32


@dataclass(slots=True)
class PenaltyInputs:
    row_ids: torch.Tensor  # [num_penalized] int64: which rows have any penalty
    repetition: torch.Tensor  # [num_penalized] float32
    presence: torch.Tensor  # [num_penalized] float32
    frequency: torch.Tensor  # [num_penalized] float32
    prompt_token_ids: torch.Tensor  # [num_penalized, max_prompt_len] int64, padded with vocab_size
    output_token_ids: torch.Tensor  # [num_penalized, max_output_len] int64, padded with vocab_size


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    is_all_greedy: bool
    is_greedy: torch.Tensor  # [num_rows] bool
    temperature: torch.Tensor  # [num_rows] float32, 1.0 on greedy rows (no division by zero)
    top_k: torch.Tensor | None  # [num_rows] int64, vocab_size = off
    max_top_k: int  # the largest top_k in use (host side: no sync to size the top-k call)
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 = off
    min_p: torch.Tensor | None  # [num_rows] float32, 0.0 = off
    logit_bias: SparseRows | None
    banned: SparseRows | None  # min_tokens' EOS/stop bans, bad words' next tokens (values unused)
    allowed: SparseRows | None  # rows with allowed_token_ids: those ids (values unused); the rest are banned
    penalties: PenaltyInputs | None
    generators: list[torch.Generator | None]  # per row; None = the engine's generator
    logprob_row_ids: torch.Tensor | None  # [num_logprob_rows] int64
    max_num_logprobs: int  # top alternatives to return (0 = only the sampled token's)


def build_sampling_metadata(requests: Sequence[Request], vocab_size: int, device: torch.device) -> SamplingMetadata:
    params = [r.params for r in requests]
    is_greedy = [p.is_greedy for p in params]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    return SamplingMetadata(
        num_rows=len(requests),
        is_all_greedy=all(is_greedy),
        is_greedy=_to_device(is_greedy, torch.bool, device),
        temperature=_floats([1.0 if g else p.temperature for g, p in zip(is_greedy, params)], device),
        top_k=_ints(top_k, device) if any(k < vocab_size for k in top_k) else None,
        max_top_k=max(top_k, default=vocab_size),
        top_p=_floats([p.top_p for p in params], device) if any(p.top_p < 1.0 for p in params) else None,
        min_p=_floats([p.min_p for p in params], device) if any(p.min_p > 0.0 for p in params) else None,
        logit_bias=_logit_bias(requests, device),
        banned=_banned(requests, device),
        allowed=_allowed(requests, device),
        penalties=_penalties(requests, vocab_size, device),
        generators=[r.generator for r in requests],
        logprob_row_ids=_ints(logprob_rows, device) if logprob_rows else None,
        max_num_logprobs=max((params[i].logprobs or 0 for i in logprob_rows), default=0),
    )


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    # The caching host allocator keeps the pinned source alive until the copy has run.
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return _to_device(values, torch.float32, device)


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    return _to_device(values, torch.int64, device)


def _sparse(entries: list[tuple[int, int, float]], device: torch.device) -> SparseRows | None:
    if not entries:
        return None
    rows, token_ids, values = zip(*entries)
    return SparseRows(_ints(list(rows), device), _ints(list(token_ids), device), _floats(list(values), device))


def _logit_bias(requests: Sequence[Request], device: torch.device) -> SparseRows | None:
    entries = [
        (row, token_id, bias)
        for row, r in enumerate(requests)
        for token_id, bias in (r.params.logit_bias or {}).items()
    ]
    return _sparse(entries, device)


def _banned(requests: Sequence[Request], device: torch.device) -> SparseRows | None:
    """EOS and stop ids until min_tokens, and each bad word's last token where the output so far ends
    with the rest of the word (a one-token word always)."""
    entries = [
        (row, token_id, 0.0)
        for row, r in enumerate(requests)
        if r.is_min_tokens_pending
        for token_id in {*r.eos_token_ids, *r.params.stop_token_ids}
    ]
    for row, r in enumerate(requests):
        for word in r.params.bad_words_token_ids or ():
            *prefix, last = word
            if not prefix or r.output_token_ids[len(r.output_token_ids) - len(prefix) :] == prefix:
                entries.append((row, last, 0.0))
    return _sparse(entries, device)


def _allowed(requests: Sequence[Request], device: torch.device) -> SparseRows | None:
    entries = [(row, t, 0.0) for row, r in enumerate(requests) for t in r.params.allowed_token_ids or ()]
    return _sparse(entries, device)


def _penalties(requests: Sequence[Request], vocab_size: int, device: torch.device) -> PenaltyInputs | None:
    rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if not rows:
        return None
    chosen = [requests[i] for i in rows]
    return PenaltyInputs(
        row_ids=_ints(rows, device),
        repetition=_floats([r.params.repetition_penalty for r in chosen], device),
        presence=_floats([r.params.presence_penalty for r in chosen], device),
        frequency=_floats([r.params.frequency_penalty for r in chosen], device),
        prompt_token_ids=_padded([r.prompt_token_ids for r in chosen], vocab_size, device),
        output_token_ids=_padded([r.output_token_ids for r in chosen], vocab_size, device),
    )


def _padded(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return _to_device([r + [pad_id] * (width - len(r)) for r in rows], torch.int64, device)


class SamplingMetadataCache:
    """Reuses the last step's metadata while the sampling batch is the same sequences in the same order
    and nothing in it changes per step (no penalties, no pending min_tokens): a steady decode batch then costs
    one identity check instead of per-row lists, pinned copies and host-to-device copies. Grammar masks, which
    change with every token, are not part of it (the sampler takes them beside it)."""

    def __init__(self) -> None:
        self._requests: tuple[Request, ...] = ()
        self._meta: SamplingMetadata | None = None

    def get(self, requests: Sequence[Request], vocab_size: int, device: torch.device) -> SamplingMetadata:
        if (
            self._meta is not None
            and len(requests) == len(self._requests)
            and all(map(operator.is_, requests, self._requests))
        ):
            return self._meta
        meta = build_sampling_metadata(requests, vocab_size, device)
        # banned: min_tokens still pending or a bad word's ban, which follows the output.
        is_static = (
            meta.penalties is None and meta.banned is None and not any(r.params.bad_words_token_ids for r in requests)
        )
        self._requests, self._meta = (tuple(requests), meta) if is_static else ((), None)
        return meta
