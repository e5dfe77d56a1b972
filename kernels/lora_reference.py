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
    is_zeroed: bool = False,  # what the kernel may skip zeroing; the reference writes its rows whatever it holds
) -> None:
    for slot, rows in slot_rows(sorted_token_ids, slot_starts):
        shrunk[rows] = x[rows].float() @ lora_a[slot].float().T


def lora_expand(
    shrunk: torch.Tensor,  # [num_tokens, num_slices * max_rank] fp32 (slice i: the i-th rank block)
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank]
    y: torch.Tensor,  # [num_tokens, out_features], added to on LoRA rows
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    slice_ends: tuple[int, ...] = (),  # each slice's last output column + 1 (the last is out_features); (): one
) -> None:
    rank = lora_b.shape[2]
    ends = slice_ends or (lora_b.shape[1],)
    for slot, rows in slot_rows(sorted_token_ids, slot_starts):
        for i, (begin, end) in enumerate(itertools.pairwise((0, *ends))):
            delta = shrunk[rows, i * rank : (i + 1) * rank] @ lora_b[slot, begin:end].float().T
            y[rows, begin:end] += delta.to(y.dtype)
