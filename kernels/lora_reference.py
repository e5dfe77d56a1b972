"""Torch reference of the LoRA shrink and expand steps: the CPU serving path and the oracle for kernels/lora.py.

A step's tokens are grouped by adapter slot on the host (`sorted_token_ids`, `slot_starts`):

    token slots       [ 1 -1  0  1  1 -1 ]        (-1: the base model, no delta)
    sorted_token_ids  [ 2 | 0 3 4 | pad... ]      slot 0's tokens, then slot 1's, ...
    slot_starts       [ 0, 1, 4, 4 ]              slot s owns sorted_token_ids[slot_starts[s]:slot_starts[s+1]]

    shrink:  shrunk[t] = x[t] @ lora_a[s]^T           [num_tokens, num_slices * max_rank]  (fp32)
    expand:  y[t, slice i] += shrunk[t, i-th rank block] @ lora_b_i[s]^T   (the scale is folded into B)

Rows of base tokens are never read or written.
"""

from __future__ import annotations

import itertools

import torch


def slot_rows(sorted_token_ids: torch.Tensor, slot_starts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its token rows) for every slot with tokens this step."""
    starts = slot_starts.tolist()
    return [
        (slot, sorted_token_ids[begin:end].long())
        for slot, (begin, end) in enumerate(itertools.pairwise(starts))
        if end > begin
    ]


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [max_loras, num_slices * max_rank, in_features]
    shrunk: torch.Tensor,  # [num_tokens, num_slices * max_rank] fp32, written on LoRA rows only
    sorted_token_ids: torch.Tensor,  # [>= num_lora_tokens] int32
    slot_starts: torch.Tensor,  # [max_loras + 1] int32
) -> None:
    for slot, rows in slot_rows(sorted_token_ids, slot_starts):
        shrunk[rows] = x[rows].float() @ lora_a[slot].float().T


def lora_expand(
    shrunk: torch.Tensor,  # [num_tokens, max_rank] fp32 (one slice's rank block)
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank]
    y: torch.Tensor,  # [num_tokens, out_features], added to on LoRA rows
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
) -> None:
    for slot, rows in slot_rows(sorted_token_ids, slot_starts):
        y[rows] += (shrunk[rows] @ lora_b[slot].float().T).to(y.dtype)
