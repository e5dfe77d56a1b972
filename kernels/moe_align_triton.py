"""moe_align_block_size as one Triton program: the torch version (kernels/moe_align.py) is ~20 small launches,
~55-85 µs of a 16-256 token step on an H100, more than a tenth of the whole MoE layer.

Same outputs and layout as the torch version (see its diagram), except that the rows inside one expert's
run are in no particular order: nothing depends on it (every row of a block is computed on its own).

    counts[e]  = #assignments of expert e            (tl.histogram over chunks of assignments)
    ends       = cumsum(roundup(counts, BLOCK_M))    start of run e = ends[e] - padded[e]
    expert of block b = #experts whose run ends at or before row b * BLOCK_M
    row of an assignment = atomic_add(cursor[its expert], 1)   (cursor starts at the run's start)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.moe_align import max_padded_rows

_CHUNK = 1024  # assignments (or padded rows) per loop step
_MAX_COMPARES = 4096  # block rows x experts compared at once (registers of one program)


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [num_assignments] int
    sorted_token_ids_ptr,  # [num_padded_rows] int64 (out)
    expert_ids_ptr,  # [num_padded_rows // BLOCK_M] int64 (out)
    num_tokens_post_padded_ptr,  # [1] int64 (out)
    cursor_ptr,  # [BINS] int32 scratch
    num_assignments,
    num_padded_rows,
    NUM_EXPERTS: tl.constexpr,
    BINS: tl.constexpr,  # power of two > NUM_EXPERTS: the last bin takes the masked lanes
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
):
    experts = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for start in range(0, num_assignments, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_assignments, other=BINS - 1).to(tl.int32)
        counts += tl.histogram(ids, BINS)
    counts = tl.where(experts < NUM_EXPERTS, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_tokens_post_padded_ptr, tl.sum(padded, axis=0).to(tl.int64))
    tl.store(cursor_ptr + experts, ends - padded)

    for first in range(0, num_padded_rows // BLOCK_M, CHUNK_BLOCKS):
        blocks = first + tl.arange(0, CHUNK_BLOCKS)
        rows = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        expert = tl.minimum(expert, NUM_EXPERTS - 1)  # blocks past the last run: never read
        tl.store(expert_ids_ptr + blocks, expert.to(tl.int64), mask=rows < num_padded_rows)
    for first in range(0, num_padded_rows, CHUNK):
        rows = first + tl.arange(0, CHUNK)
        padding = tl.zeros([CHUNK], tl.int64) + num_assignments
        tl.store(sorted_token_ids_ptr + rows, padding, mask=rows < num_padded_rows)
    tl.debug_barrier()  # the padding marks and cursors are in place before any row is claimed

    for start in range(0, num_assignments, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_assignments
        ids = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
        row = tl.atomic_add(cursor_ptr + ids, 1, mask=mask)
        tl.store(sorted_token_ids_ptr + row, offs.to(tl.int64), mask=mask)


def moe_align_block_size_triton(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    block_m: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [max_padded] int64, expert_ids [max_padded // block_m] int64,
    num_tokens_post_padded [1] int64), like `moe_align.moe_align_block_size`; one launch, no host sync."""
    flat = topk_ids.reshape(-1)
    num_assignments, device = flat.numel(), flat.device
    num_padded_rows = max_padded_rows(num_assignments, num_experts, block_m)
    sorted_token_ids = torch.empty(num_padded_rows, dtype=torch.int64, device=device)
    expert_ids = torch.empty(num_padded_rows // block_m, dtype=torch.int64, device=device)
    num_tokens_post_padded = torch.empty(1, dtype=torch.int64, device=device)
    bins = triton.next_power_of_2(num_experts + 1)
    cursor = torch.empty(bins, dtype=torch.int32, device=device)
    _moe_align_kernel[(1,)](
        flat,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        cursor,
        num_assignments,
        num_padded_rows,
        NUM_EXPERTS=num_experts,
        BINS=bins,
        BLOCK_M=block_m,
        CHUNK=_CHUNK,
        CHUNK_BLOCKS=max(16, _MAX_COMPARES // bins),
        num_warps=4,
    )
    return sorted_token_ids, expert_ids, num_tokens_post_padded
