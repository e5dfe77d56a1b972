"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023), one row per verified position.

A sequence with k drafts has k + 1 rows. Row j holds the target's distribution p_j after the context and the
drafts d_0..d_{j-1}; rows j < k also hold d_j and the distribution q_j it was drafted from:

    row:      0          1          ...   k-1            k
    draft:    d_0        d_1              d_{k-1}        (none: the bonus row)
    accept:   u_0 < p_0(d_0)/q_0(d_0) ...
    emitted:  d_0 while accepted; at the first rejection a draw from max(p_j - q_j, 0), then stop;
              after k acceptances a bonus draw from p_k.

The emitted tokens are then distributed exactly as the target's own samples. Our proposers draft
deterministically (n-gram lookup, a greedy draft model): q_j is one-hot at d_j, so acceptance is p_j(d_j)
and the residual is p_j without d_j. Greedy rows accept while the draft is the target's argmax and then emit
the argmax: exactly the non-speculative output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_drafts(
    target_probs: torch.Tensor,  # [num_rows, vocab] normalized
    draft_token_ids: torch.Tensor,  # [num_rows] int64, -1 on bonus rows
    uniform: torch.Tensor,  # [num_rows] float32 in [0, 1)
    draft_probs: torch.Tensor | None = None,  # [num_rows, vocab] normalized; None: one-hot at the draft
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, whether its draft is accepted ([num_rows] bool, False on bonus rows), and the distribution to
    draw from where it is not ([num_rows, vocab], unnormalized: the residual, or p itself on bonus rows)."""
    has_draft = draft_token_ids >= 0
    ids = draft_token_ids.clamp(min=0)[:, None]
    p_draft = target_probs.gather(1, ids)[:, 0]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = target_probs.scatter(1, ids, 0.0)
    else:
        q_draft = draft_probs.gather(1, ids)[:, 0]
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    residual = torch.where(has_draft[:, None], residual, target_probs)
    accepted = has_draft & (uniform * q_draft < p_draft)  # u < p/q, with no division by a zero q
    return accepted, residual


def num_accepted(accepted: Sequence[bool], num_drafts: Sequence[int]) -> list[int]:
    """Per sequence (its k + 1 rows back to back), how many leading drafts were accepted."""
    counts, row = [], 0
    for k in num_drafts:
        count = 0
        while count < k and accepted[row + count]:
            count += 1
        counts.append(count)
        row += k + 1
    return counts
