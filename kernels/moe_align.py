"""Sort a step's (token, slot) expert assignments by expert, each expert's run padded to the GEMM's BLOCK_M.

    topk_ids [num_tokens, top_k] -> assignments a = token * top_k + slot, a in [0, num_tokens * top_k)

    sorted_token_ids  | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e5 -- -- -- | -- ... (to max_padded)
                        block 0       block 1       block 2       block 3
    expert_ids          0             2             2             5
    (-- = padding, marked by the value num_tokens * top_k; every block holds one expert's rows)

Plain torch on the tensors' device, no host sync and no loop over experts, so the sizes are fixed by
host integers (a CUDA graph captures it) and the grouped GEMM (kernels/fused_moe.py) reads how many
rows are real from `num_tokens_post_padded`. Blocks past it are never read. A single token (batch-1
decode) needs no sort: its top_k experts are distinct, so each slot is one block, in slot order.
"""

from __future__ import annotations

from functools import cache

import torch


def max_padded_rows(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Rows `sorted_token_ids` needs at most: each hit expert wastes < block_m rows on padding, and at most
    min(num_experts, num_assignments) experts are hit."""
    hit = min(num_experts, num_assignments)
    return -(-(num_assignments + hit * (block_m - 1)) // block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    block_m: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [max_padded] int64, expert_ids [max_padded // block_m] int64,
    num_tokens_post_padded [1] int64)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_assignments, device = flat.numel(), flat.device
    if topk_ids.shape[0] == 1:
        # Made once per shape, but not while a CUDA graph captures: a capture runs no kernel, so a tensor
        # first filled there stays unfilled until that graph replays.
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        layout = _one_token_layout.__wrapped__ if capturing else _one_token_layout
        sorted_token_ids, num_tokens_post_padded = layout(num_assignments, block_m, device)
        return sorted_token_ids, flat, num_tokens_post_padded
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)  # [num_experts] end row of each expert's padded run
    order = flat.argsort(stable=True)  # assignments grouped by expert, token order kept inside a group
    expert_of = flat[order]
    # Row of the i-th sorted assignment: its expert's padded start + its rank among that expert's rows.
    rank = torch.arange(num_assignments, device=device) - (counts.cumsum(0) - counts)[expert_of]
    rows = padded_end[expert_of] - padded[expert_of] + rank
    total = max_padded_rows(num_assignments, num_experts, block_m)
    sorted_token_ids = torch.full((total,), num_assignments, dtype=torch.int64, device=device)
    sorted_token_ids[rows] = order
    block_starts = torch.arange(0, total, block_m, device=device)
    # The expert whose padded run holds each block's first row (blocks past the last run: clamped, unread).
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_token_ids, expert_ids, padded_end[-1:].clone()


@cache
def _one_token_layout(top_k: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot i alone in block i: constant for the shape, so made once (no launches in a decode step)."""
    sorted_token_ids = torch.full((top_k, block_m), top_k, dtype=torch.int64, device=device)
    sorted_token_ids[:, 0] = torch.arange(top_k, device=device)
    return sorted_token_ids.view(-1), torch.full((1,), top_k * block_m, dtype=torch.int64, device=device)
