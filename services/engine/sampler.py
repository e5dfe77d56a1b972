"""Batched sampling on the engine's device: one row per sampling sequence, no loops over the vocabulary.

Order (as in vLLM v1): logprobs of the raw logits -> logit_bias, min_tokens bans -> penalties ->
greedy argmax | temperature -> min_p -> top_k / top_p -> a draw.

A draw is `argmax(probs / q)` with `q ~ Exponential(1)` per vocabulary entry (the exponential race,
equivalent to sampling from `probs`). Rows with a seed fill their own `q` row from their private
generator, so their tokens do not depend on which other sequences share the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.sampling_metadata import PenaltyInputs, SamplingMetadata


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

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # [num_rows, vocab]; a copy we may edit in place
        raw_logprobs = None
        if meta.logprob_row_ids is not None:
            raw_logprobs = torch.log_softmax(logits[meta.logprob_row_ids], dim=-1)
        apply_logit_edits(logits, meta)
        greedy_ids = logits.argmax(dim=-1)
        if meta.is_all_greedy:
            sampled = greedy_ids
        else:
            probs = sampling_probs(logits, meta)
            sampled = torch.where(meta.is_greedy, greedy_ids, self._draw(probs, meta))
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None)
        token_ids, logprobs = gather_logprobs(raw_logprobs, sampled[meta.logprob_row_ids], meta.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs)

    def _draw(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        q = torch.empty_like(probs)  # [num_rows, vocab]
        q.exponential_(generator=self.generator)
        for row, generator in enumerate(meta.generators):
            if generator is not None:
                q[row].exponential_(generator=generator)
        # q == 0 would turn a banned token's 0/0 into NaN, which argmax picks.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)


def apply_logit_edits(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """logit_bias, min_tokens bans and penalties, in place on [num_rows, vocab] logits."""
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
    """Temperature, min_p, top_k and top_p applied; probabilities [num_rows, vocab]."""
    logits = logits / meta.temperature[:, None]
    if meta.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if meta.top_p is not None:
        logits = _top_k_top_p_sorted(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        logits = _top_k(logits, meta.top_k)
    return torch.softmax(logits, dim=-1)


def _top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep logits >= each row's k-th largest (ties at the boundary may keep a few more)."""
    max_k = int(top_k.max())
    top_values = logits.topk(max_k, dim=-1).values  # [num_rows, max_k]
    kth = top_values.gather(1, (top_k - 1).clamp(max=max_k - 1)[:, None])  # [num_rows, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [num_rows, vocab]
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)
        sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token once the more likely ones already reach p; the most likely one always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    threshold = top_p.masked_fill(top_p >= 1.0, float("inf"))  # rounding must not cut p = 1 rows
    sorted_logits.masked_fill_(mass_before >= threshold[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


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
