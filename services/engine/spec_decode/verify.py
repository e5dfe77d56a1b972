"""The verify half of a speculative step: the target's logits at every draft position -> the tokens to emit.

Each sampling sequence brings k + 1 rows of logits (its last known token and its k drafts went through one
forward, spec_decode/__init__.py). Every row is sampled under the sequence's own parameters as if the drafts
before it had been emitted: penalties, bad words and min_tokens see them (a per-row view of the request), so
the target distribution is exactly the one non-speculative decoding would sample from. Logprobs are the
target's, of the tokens emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pagedserve.services.engine.outputs import TokenLogprob
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampler import Sampler, apply_logit_edits, gather_logprobs, sampling_probs
from pagedserve.services.engine.sampling_metadata import SamplingMetadata, build_sampling_metadata
from pagedserve.services.engine.spec_decode.rejection_sampler import accept_drafts, num_accepted
from pagedserve.services.engine.structured.bitmask import apply_token_bitmask, build_token_bitmask


@dataclass(slots=True)
class VerifiedTokens:
    token_ids: list[list[int]]  # per sampling sequence: its accepted drafts, then the target's own token
    logprobs: list[list[TokenLogprob] | None]  # likewise, where asked
    num_drafts: list[int]  # drafts verified per sequence
    num_accepted: list[int]  # of which accepted (before a stop token or a length limit cuts the sequence)


def row_requests(requests: Sequence[Request], drafts: Sequence[Sequence[int]]) -> list[Request]:
    """One request per logits row: row j of a sequence sees its drafts before j as output tokens. Only
    sequences whose sampling reads the output (penalties, bad words, min_tokens/characters) need a copy."""
    rows: list[Request] = []
    for request, draft in zip(requests, drafts, strict=True):
        rows.append(request)
        params = request.params
        if params.has_penalties or params.bad_words_token_ids or params.min_tokens or params.min_characters:
            tokens = request.all_token_ids
            rows.extend(replace(request, all_token_ids=tokens + list(draft[:j])) for j in range(1, len(draft) + 1))
        else:
            rows.extend([request] * len(draft))
    return rows


def verify(
    sampler: Sampler,
    logits: torch.Tensor,  # [num_rows, vocab]: k + 1 rows per sampling sequence, in schedule order
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],
    vocab_size: int,
) -> VerifiedTokens:
    device = logits.device
    rows = row_requests(requests, drafts)
    meta = build_sampling_metadata(rows, vocab_size, device)
    logits = logits.float()
    token_bitmask = build_token_bitmask(rows, vocab_size, device)  # a grammar row never drafts: one row each
    if token_bitmask is not None:
        apply_token_bitmask(logits, token_bitmask)
    raw_logprobs = None
    if meta.logprob_row_ids is not None:
        raw_logprobs = torch.log_softmax(logits[meta.logprob_row_ids], dim=-1)
    apply_logit_edits(logits, meta)
    greedy_ids = logits.argmax(dim=-1)  # [num_rows]
    draft_ids = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.int64, device=device)
    if meta.is_all_greedy:
        accepted, emitted = draft_ids == greedy_ids, greedy_ids  # an accepted draft is the argmax
    else:
        probs = sampling_probs(logits, meta)
        probs /= probs.sum(dim=-1, keepdim=True)
        is_accepted, residual = accept_drafts(probs, draft_ids, _uniform(sampler, meta))
        recovered = sampler._draw(residual, meta, greedy_ids)
        accepted = torch.where(meta.is_greedy, draft_ids == greedy_ids, is_accepted)
        emitted = torch.where(meta.is_greedy, greedy_ids, torch.where(is_accepted, draft_ids, recovered))
    logprob_ids = logprob_values = None
    if raw_logprobs is not None and meta.logprob_row_ids is not None:
        logprob_ids, logprob_values = gather_logprobs(
            raw_logprobs, emitted[meta.logprob_row_ids], meta.max_num_logprobs
        )
    return _assemble(requests, drafts, accepted.tolist(), emitted.tolist(), meta, logprob_ids, logprob_values)


def _uniform(sampler: Sampler, meta: SamplingMetadata) -> torch.Tensor:
    """One acceptance draw per row; a row with a seed draws from its own generator."""
    uniform = torch.rand(meta.num_rows, generator=sampler.generator, device=meta.is_greedy.device)
    for row, generator in enumerate(meta.generators):
        if generator is not None:
            uniform[row] = torch.rand(1, generator=generator, device=uniform.device)
    return uniform


def _assemble(
    requests: Sequence[Request],
    drafts: Sequence[Sequence[int]],
    accepted: list[bool],
    emitted: list[int],
    meta: SamplingMetadata,
    logprob_ids: torch.Tensor | None,
    logprob_values: torch.Tensor | None,
) -> VerifiedTokens:
    num_drafts = [len(d) for d in drafts]
    counts = num_accepted(accepted, num_drafts)
    lp_index: dict[int, int] = {}  # row -> its row in the logprob block
    lp_ids: list[list[int]] = []
    lp_values: list[list[float]] = []
    if logprob_ids is not None and logprob_values is not None and meta.logprob_row_ids is not None:
        lp_index = {row: i for i, row in enumerate(meta.logprob_row_ids.tolist())}
        lp_ids, lp_values = logprob_ids.tolist(), logprob_values.tolist()
    token_ids: list[list[int]] = []
    logprobs: list[list[TokenLogprob] | None] = []
    start = 0
    for request, k, count in zip(requests, num_drafts, counts):
        token_ids.append(emitted[start : start + count + 1])
        num_top = request.params.logprobs
        if num_top is None:
            logprobs.append(None)
        else:
            entries = []
            for row in range(start, start + count + 1):
                ids, values = lp_ids[lp_index[row]], lp_values[lp_index[row]]
                top = [(ids[1 + j], values[1 + j]) for j in range(num_top)]
                entries.append(TokenLogprob(ids[0], values[0], top))
            logprobs.append(entries)
        start += k + 1
    return VerifiedTokens(token_ids, logprobs, num_drafts, counts)
