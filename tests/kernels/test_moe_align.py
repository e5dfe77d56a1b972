"""moe_align_block_size: every (token, slot) assignment lands once, in a block of its own expert, padding
marked; the padded length is the host-computed bound (what a CUDA graph needs)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedserve.kernels.moe_align import max_padded_rows, moe_align_block_size

Align = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def check_alignment(
    topk_ids: torch.Tensor,
    block_m: int,
    num_experts: int,
    align: Align = moe_align_block_size,
    runs_in_expert_order: bool = True,  # (not the one-token layout: a block per slot, in slot order)
    keeps_token_order: bool = True,  # (not the Triton version: rows claimed by atomics)
) -> None:
    sorted_ids, expert_ids, post_padded = align(topk_ids, block_m, num_experts)
    num_assignments = topk_ids.numel()
    flat = topk_ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    used = int(post_padded.item())
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.shape == (max_padded_rows(num_assignments, num_experts, block_m),)
    assert used <= sorted_ids.numel() and sorted_ids.numel() % block_m == 0
    assert expert_ids.shape == (sorted_ids.numel() // block_m,)
    real = sorted_ids[:used]
    is_pad = real == num_assignments
    # Every assignment exactly once; all else (and everything past `used`) is the padding marker.
    assert sorted(real[~is_pad].tolist()) == list(range(num_assignments))
    assert bool((sorted_ids[used:] == num_assignments).all())
    blocks = real.view(-1, block_m)
    for block, expert in zip(blocks, expert_ids[: used // block_m].tolist()):
        rows = block[block != num_assignments]
        assert rows.numel() > 0, "a block in use holds real rows"
        assert bool((flat[rows] == expert).all()), "every row of a block belongs to the block's expert"
        assert bool((block[: rows.numel()] == rows).all()), "padding only at the end of an expert's run"
        if keeps_token_order:
            assert bool((rows[1:] > rows[:-1]).all()), "an expert's rows keep token order"
    assert set(expert_ids[: used // block_m].tolist()) == set(flat.tolist())
    if runs_in_expert_order:
        assert expert_ids[: used // block_m].tolist() == sorted(expert_ids[: used // block_m].tolist())


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m"), [(37, 2, 8, 16), (5, 8, 64, 16), (300, 4, 6, 32)]
)
def test_assignments_sorted_by_expert_and_padded(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    topk_ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    check_alignment(topk_ids, block_m, num_experts)


def test_one_token_gets_a_block_per_slot_without_a_sort() -> None:
    ids = torch.tensor([[6, 2, 9]])
    check_alignment(ids, 16, 12, runs_in_expert_order=False)
    sorted_ids, expert_ids, post_padded = moe_align_block_size(ids, 16, 12)
    assert expert_ids.tolist() == [6, 2, 9] and int(post_padded.item()) == 48
    assert sorted_ids.view(3, 16)[:, 0].tolist() == [0, 1, 2]
    again, _, _ = moe_align_block_size(torch.tensor([[1, 0, 3]]), 16, 12)
    assert again is sorted_ids  # the layout depends on the shape only: made once


def test_runs_that_fill_whole_blocks_and_unhit_experts() -> None:
    # Expert 1: exactly one block of 16; expert 3: 17 rows (two blocks); experts 0, 2, 4..7 unhit.
    ids = torch.tensor([1] * 16 + [3] * 17).view(-1, 1)
    check_alignment(ids, 16, 8)
    _, expert_ids, post_padded = moe_align_block_size(ids, 16, 8)
    assert int(post_padded.item()) == 48 and expert_ids[:3].tolist() == [1, 3, 3]


def test_every_expert_hit_once_fits_the_bound() -> None:
    """The worst padding: each expert one row, so each wastes block_m - 1 rows."""
    ids = torch.arange(12).view(6, 2)
    check_alignment(ids, 16, 12)
    assert max_padded_rows(12, 12, 16) == 12 * 16


def test_no_tokens() -> None:
    sorted_ids, expert_ids, post_padded = moe_align_block_size(torch.empty(0, 2, dtype=torch.int64), 16, 8)
    assert sorted_ids.numel() == 0 and expert_ids.numel() == 0 and post_padded.tolist() == [0]
