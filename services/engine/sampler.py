"""Batched sampling on the engine's device: one row per sampling sequence, no loops over the vocabulary.

Order (as in vLLM v1): grammar bitmask -> logprobs of the raw logits -> allowed_token_ids, logit_bias, bans
(min_tokens, bad words) -> penalties -> greedy argmax | temperature -> min_p -> top_k -> top_p -> a draw.

Filters zero out probabilities instead of renormalizing, and a draw is an inverse-CDF lookup with
one uniform number per row: `searchsorted(cumsum(probs), u * total)`. That needs no sort of the
vocabulary (top_p looks at the 256 most likely tokens and sorts only rows they do not settle), no
vocabulary-sized random tensor and no host sync (on CUDA top_p sorts every row instead of syncing
to find the few that need it; top_k's width comes from the host). Rows with a seed draw `u` from their private
generator, so their tokens do not depend on which other sequences share the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.services.engine.sampling_metadata import PenaltyInputs, SamplingMetadata
from pagedserve.services.engine.structured.bitmask import TokenBitmask, apply_token_bitmask


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_rows] int64
    # For the rows in metadata.logprob_row_ids only; column 0 is the sampled token, 1.. the top k.
    logprob_token_ids: torch.Tensor | None  # [num_logprob_rows, 1 + max_num_logprobs] int64
    logprobs: torch.Tensor | None  # [num_logprob_rows, 1 + max_num_logprobs] float32


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device)  # rows without a seed of their own
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, token_bitmask: TokenBitmask | None = None
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [num_rows, vocab] (edited in place when fp32); `token_bitmask`
        holds the grammar rows' allowed tokens."""
        logits = logits.float()
        if token_bitmask is not None:  # grammar rows: disallowed tokens can neither be sampled nor listed
            apply_token_bitmask(logits, token_bitmask)
        raw_logprobs = None
        if meta.logprob_row_ids is not None:
            raw_logprobs = torch.log_softmax(logits[meta.logprob_row_ids], dim=-1)
        apply_logit_edits(logits, meta)
        greedy_ids = logits.argmax(dim=-1)
        if meta.is_all_greedy:
            sampled = greedy_ids
        else:
            probs = sampling_probs(logits, meta)
            sampled = torch.where(meta.is_greedy, greedy_ids, self._draw(probs, meta, greedy_ids))
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None)
        token_ids, logprobs = gather_logprobs(raw_logprobs, sampled[meta.logprob_row_ids], meta.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs)

    def _draw(self, probs: torch.Tensor, meta: SamplingMetadata, fallback_ids: torch.Tensor) -> torch.Tensor:
        """One token per row from unnormalized probabilities [num_rows, vocab]."""
        num_rows, vocab_size = probs.shape
        uniform = torch.rand(num_rows, 1, generator=self.generator, device=probs.device)
        for row, generator in enumerate(meta.generators):
            if generator is not None:
                uniform[row] = torch.rand(1, generator=generator, device=probs.device)
        cdf = probs.cumsum(dim=-1)  # [num_rows, vocab]
        token_ids = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=vocab_size - 1)[:, 0]
        # Rounding can step past the last token with mass: a zero-probability token must never win.
        has_mass = probs.gather(1, token_ids[:, None])[:, 0] > 0
        return torch.where(has_mass, token_ids, fallback_ids)


def apply_logit_edits(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """allowed_token_ids, logit_bias, bans (min_tokens, bad words) and penalties, in place on [num_rows, vocab]
    logits."""
    if meta.allowed is not None:
        allowed = meta.allowed
        kept = logits[allowed.row_ids, allowed.token_ids]
        logits[allowed.row_ids] = float("-inf")  # every row with a list, whole
        logits[allowed.row_ids, allowed.token_ids] = kept
    if meta.logit_bias is not None:
        bias = meta.logit_bias
        logits.index_put_((bias.row_ids, bias.token_ids), bias.values, accumulate=True)
    if meta.banned is not None:
        logits[meta.banned.row_ids, meta.banned.token_ids] = float("-inf")
    if meta.penalties is not None:
        rows = meta.penalties.row_ids
        logits[rows] = apply_penalties(logits[rows], meta.penalties)


def apply_penalties(logits: torch.Tensor, pen: PenaltyInputs) -> torch.Tensor:
    """Repetition (over prompt and output, HF/vLLM style), presence and frequency (output only)."""
    num_rows, vocab_size = logits.shape
    # Padding ids equal vocab_size: count into one spare column, then drop it.
    output_counts = torch.zeros(num_rows, vocab_size + 1, device=logits.device)
    output_counts.scatter_add_(1, pen.output_token_ids, torch.ones_like(pen.output_token_ids, dtype=torch.float32))
    output_counts = output_counts[:, :vocab_size]  # [num_rows, vocab]
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, pen.prompt_token_ids, True)
    seen = seen[:, :vocab_size] | (output_counts > 0)  # [num_rows, vocab]
    repetition = pen.repetition[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits -= pen.frequency[:, None] * output_counts
    logits -= pen.presence[:, None] * (output_counts > 0).float()
    return logits


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature, then min_p, top_k and top_p as zeroed entries: unnormalized [num_rows, vocab]."""
    probs = torch.softmax(logits / meta.temperature[:, None], dim=-1)
    if meta.min_p is not None:
        threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p[:, None]
        probs.masked_fill_(probs < threshold, 0.0)
    if meta.top_k is not None:
        max_k = min(meta.max_top_k, probs.shape[1])
        top = probs.topk(max_k, dim=-1).values  # [num_rows, max_k]
        kth = top.gather(1, (meta.top_k - 1).clamp(max=max_k - 1)[:, None])  # ties may keep a few more
        probs.masked_fill_(probs < kth, 0.0)
    if meta.top_p is not None:
        probs.masked_fill_(probs < _top_p_threshold(probs, meta.top_p), 0.0)
    return probs


TOP_P_CANDIDATES = 256


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:  # [num_rows, 1]
    """The smallest probability kept by top_p: tokens go, least likely first, while the more likely
    ones alone reach p of the remaining mass. Rows with p = 1 keep everything (threshold 0)."""
    total = probs.sum(dim=-1, keepdim=True)  # < 1 after min_p / top_k
    target = top_p[:, None] * total
    num_candidates = min(TOP_P_CANDIDATES, probs.shape[1])
    candidates = probs.topk(num_candidates, dim=-1).values  # [num_rows, num_candidates], descending
    threshold = _threshold_in_sorted(candidates, target)
    unsettled = (candidates.sum(dim=-1, keepdim=True) < target) & (top_p[:, None] < 1.0)
    if num_candidates < probs.shape[1] and probs.device.type == "cuda":
        # No host sync to find the flat rows: sort every row (a GPU sorts a batch in well under a ms).
        full = _threshold_in_sorted(probs.sort(dim=-1, descending=True).values, target)
        threshold = torch.where(unsettled, full, threshold)
    elif num_candidates < probs.shape[1] and bool(unsettled.any()):  # a flat distribution: sort those rows
        rows = unsettled[:, 0].nonzero()[:, 0]
        sorted_probs = probs[rows].sort(dim=-1, descending=True).values
        threshold[rows] = _threshold_in_sorted(sorted_probs, target[rows])
    return threshold.masked_fill(top_p[:, None] >= 1.0, 0.0)


def _threshold_in_sorted(sorted_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    num_kept = (mass_before < target).sum(dim=-1, keepdim=True).clamp(min=1)  # the best always stays
    return sorted_probs.gather(1, num_kept - 1)


def gather_logprobs(
    logprobs: torch.Tensor,  # [num_rows, vocab]
    sampled_token_ids: torch.Tensor,  # [num_rows] int64
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # both [num_rows, 1 + num_top]
    sampled_logprobs = logprobs.gather(1, sampled_token_ids[:, None])
    if num_top == 0:
        return sampled_token_ids[:, None], sampled_logprobs
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return (
        torch.cat([sampled_token_ids[:, None], top_ids], dim=1),
        torch.cat([sampled_logprobs, top_logprobs], dim=1),
    )
