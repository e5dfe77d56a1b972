"""LoRA shrink and expand (SGMV style): one launch each covers every adapter slot of a mixed batch.

Tokens arrive grouped by slot (see kernels/lora_reference.py for the layout and the math):

    grid = (max_loras, cdiv(num_tokens, BLOCK_M), cdiv(N, BLOCK_N) [* SPLIT_K for the shrink])
    program (s, m, n): rows sorted_token_ids[slot_starts[s] + m*BLOCK_M ...] (fewer at a slot's end),
                       returns at once when slot s has no m-th tile of tokens

The shrink's N is tiny (slices x rank, e.g. 48) and its K the hidden size (4096-14336): for a decode batch one
program per slot would walk all of K alone, tens of µs per projection. There it splits K over SPLIT_K programs
that add their partial sums into the zeroed fp32 output (atomics: the sum order may vary in the last bits).

The expand covers every slice of a fused projection (q | k | v, gate | up) in one launch: its column tiles are
laid slice after slice (none straddles two), and slice i's tiles read the rank block i of `shrunk` (columns
i*RANK ..), so a layer's LoRA is one shrink and one expand per projection (8 launches; a per-slice expand made
it 11).

The grid depends only on the step's (padded) token count and the slot count, and the grouping is read
from device tensors, so a captured CUDA graph replays any mix of adapters; no host sync.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

_BLOCK_N = 64
_BLOCK_K = 64


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 128 else 64


SPLIT_K_MAX_TOKENS = 64  # bigger batches have programs enough across slots and row tiles
_MIN_K_TILES_PER_SPLIT = 4
_MAX_SPLIT_K = 32


def _split_k(num_tokens: int, k: int) -> int:
    if num_tokens > SPLIT_K_MAX_TOKENS:
        return 1
    return max(1, min(_MAX_SPLIT_K, triton.cdiv(k, _BLOCK_K) // _MIN_K_TILES_PER_SPLIT))


@triton.jit
def _slot_rows(sorted_ids_ptr, slot_starts_ptr, slot, tile_m, BLOCK_M: tl.constexpr):
    """This tile's token rows (int64) and which of them are real, or an empty mask past the slot's end."""
    start = tl.load(slot_starts_ptr + slot)
    end = tl.load(slot_starts_ptr + slot + 1)
    offs = start + tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    is_row = offs < end
    rows = tl.load(sorted_ids_ptr + offs, mask=is_row, other=0).to(tl.int64)
    return rows, is_row, start + tile_m * BLOCK_M < end


@triton.jit
def _shrink_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [max_loras, N, K]
    out_ptr,  # [num_tokens, N] fp32
    sorted_ids_ptr,  # [>= num_lora_tokens] int32
    slot_starts_ptr,  # [max_loras + 1] int32
    stride_x_t,
    stride_a_l,
    stride_a_n,
    stride_out_t,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,  # a multiple of BLOCK_K
):
    slot = tl.program_id(0)
    rows, is_row, has_rows = _slot_rows(sorted_ids_ptr, slot_starts_ptr, slot, tl.program_id(1), BLOCK_M)
    if not has_rows:
        return
    tile_n, split = tl.program_id(2) // SPLIT_K, tl.program_id(2) % SPLIT_K
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot.to(tl.int64) * stride_a_l
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_PER_SPLIT, K), BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(
            x_ptr + rows[:, None] * stride_x_t + ks[None, :], mask=is_row[:, None] & (ks[None, :] < K), other=0.0
        )  # [BLOCK_M, BLOCK_K]
        a_mask = (offs_n[None, :] < N) & (ks[:, None] < K)  # A^T tile: [BLOCK_K, BLOCK_N]
        a = tl.load(a_base + offs_n[None, :] * stride_a_n + ks[:, None], mask=a_mask, other=0.0)
        acc += tl.dot(x, a)
    out = out_ptr + rows[:, None] * stride_out_t + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=is_row[:, None] & (offs_n[None, :] < N))
    else:
        tl.atomic_add(out, acc, mask=is_row[:, None] & (offs_n[None, :] < N))


@triton.jit
def _expand_kernel(
    shrunk_ptr,  # [num_tokens, NUM_SLICES * RANK] fp32 (may be a column view)
    b_ptr,  # [max_loras, N, RANK]
    y_ptr,  # [num_tokens, N] (may be a column view), added to
    sorted_ids_ptr,
    slot_starts_ptr,
    stride_s_t,
    stride_b_l,
    stride_b_n,
    stride_y_t,
    N: tl.constexpr,
    RANK: tl.constexpr,
    END_0: tl.constexpr,  # slice i holds output columns END_{i-1} .. END_i (N for slices past the last)
    END_1: tl.constexpr,
    TILES_0: tl.constexpr,  # slice i's column tiles: cdiv(END_i - END_{i-1}, BLOCK_N) (0 past the last)
    TILES_1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    slot = tl.program_id(0)
    rows, is_row, has_rows = _slot_rows(sorted_ids_ptr, slot_starts_ptr, slot, tl.program_id(1), BLOCK_M)
    if not has_rows:
        return
    # Column tiles never straddle two slices: a tile computes exactly what a launch for its slice alone did.
    tile_n = tl.program_id(2)
    is_past_0, is_past_1 = tile_n >= TILES_0, tile_n >= TILES_0 + TILES_1
    first_tile = tl.where(is_past_1, TILES_0 + TILES_1, tl.where(is_past_0, TILES_0, 0))
    begin = tl.where(is_past_1, END_1, tl.where(is_past_0, END_0, 0))
    end = tl.where(is_past_1, N, tl.where(is_past_0, END_1, END_0))
    rank_start = (is_past_0.to(tl.int32) + is_past_1.to(tl.int32)) * RANK  # the slice's rank block in `shrunk`
    offs_n = begin + (tile_n - first_tile) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    b = tl.load(
        b_ptr + slot.to(tl.int64) * stride_b_l + offs_n[None, :] * stride_b_n + offs_r[:, None],
        mask=(offs_n[None, :] < end) & (offs_r[:, None] < RANK),
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]: B^T
    s_mask = is_row[:, None] & (offs_r[None, :] < RANK)
    s = tl.load(
        shrunk_ptr + rows[:, None] * stride_s_t + rank_start + offs_r[None, :], mask=s_mask, other=0.0
    )  # [BLOCK_M, BLOCK_R]
    delta = tl.dot(s.to(b.dtype), b)  # fp32 accumulate; the rank block rounded to the weights' dtype
    y = y_ptr + rows[:, None] * stride_y_t + offs_n[None, :]
    mask = is_row[:, None] & (offs_n[None, :] < end)
    tl.store(y, (tl.load(y, mask=mask, other=0.0).to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [max_loras, num_slices * max_rank, in_features]
    shrunk: torch.Tensor,  # [num_tokens, num_slices * max_rank] fp32: written (LoRA rows; others maybe zeroed)
    sorted_token_ids: torch.Tensor,  # [>= num_lora_tokens] int32
    slot_starts: torch.Tensor,  # [max_loras + 1] int32
    is_zeroed: bool = False,  # shrunk holds zeros already (the caller zeroed a whole step's buffer at once)
) -> None:
    num_tokens, k = x.shape
    max_loras, n, _ = lora_a.shape
    assert x.stride(1) == 1 and lora_a.stride(2) == 1 and shrunk.stride(1) == 1 and shrunk.dtype == torch.float32
    if num_tokens == 0:
        return
    block_m = _block_m(num_tokens)
    split_k = _split_k(num_tokens, k)
    if split_k > 1 and not is_zeroed:
        shrunk.zero_()  # the splits add into it
    k_per_split = triton.cdiv(triton.cdiv(k, _BLOCK_K), split_k) * _BLOCK_K
    grid = (max_loras, triton.cdiv(num_tokens, block_m), triton.cdiv(n, _BLOCK_N) * split_k)
    _shrink_kernel[grid](
        x,
        lora_a,
        shrunk,
        sorted_token_ids,
        slot_starts,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        shrunk.stride(0),
        N=n,
        K=k,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
        SPLIT_K=split_k,
        K_PER_SPLIT=k_per_split,
        num_warps=4,
    )


def lora_expand(
    shrunk: torch.Tensor,  # [num_tokens, num_slices * max_rank] fp32 (may be a column view)
    lora_b: torch.Tensor,  # [max_loras, out_features, max_rank] (may be a row view)
    y: torch.Tensor,  # [num_tokens, out_features] (may be a column view), added to
    sorted_token_ids: torch.Tensor,
    slot_starts: torch.Tensor,
    slice_ends: tuple[int, ...] = (),  # each slice's last output column + 1 (the last is out_features); (): one
) -> None:
    num_tokens = shrunk.shape[0]
    max_loras, n, rank = lora_b.shape
    ends = slice_ends or (n,)
    assert 1 <= len(ends) <= 3 and ends[-1] == n and shrunk.shape[1] == len(ends) * rank
    assert shrunk.stride(1) == 1 and lora_b.stride(2) == 1 and y.stride(1) == 1 and y.shape == (num_tokens, n)
    if num_tokens == 0:
        return
    padded_ends = (*ends, n, n)
    tiles = [triton.cdiv(end - begin, _BLOCK_N) for begin, end in itertools.pairwise((0, *ends))]
    block_m = _block_m(num_tokens)
    grid = (max_loras, triton.cdiv(num_tokens, block_m), sum(tiles))
    _expand_kernel[grid](
        shrunk,
        lora_b,
        y,
        sorted_token_ids,
        slot_starts,
        shrunk.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        y.stride(0),
        N=n,
        RANK=rank,
        END_0=padded_ends[0],
        END_1=padded_ends[1],
        TILES_0=tiles[0],
        TILES_1=tiles[1] if len(tiles) > 1 else 0,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_R=max(16, triton.next_power_of_2(rank)),
        num_warps=4,
    )
