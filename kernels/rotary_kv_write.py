"""Rotary embedding of q and k fused with writing k/v to the paged cache: one launch instead of ~15.

One program per token. With positions p and cos/sin rows of `cos_sin` (HF's duplicated-halves layout,
`[max_position, rotary_dim]`, only the first half read), the NeoX "rotate half" form

    x1, x2 = x[:half], x[half:rotary_dim]
    x[:half]           = x1 * cos - x2 * sin
    x[half:rotary_dim] = x2 * cos + x1 * sin        (dims past rotary_dim pass through)

is applied in place to q (read later by attention) and k, then k and v go to slot `slot_mapping[t]`
of the cache (see kernels/kv_write.py for the slot arithmetic; slot -1 = padding, not written).
K/V are multiplied by `1 / scale` before the store (1.0 unless the cache holds fp8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.launch_config import next_power_of_2
from pagedserve.kernels.pdl import prologue


@triton.jit
def _rotate_rows(
    ptr,
    stride_head,
    cos,
    sin,
    NUM: tl.constexpr,
    NUM_PADDED: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    offs_h = tl.arange(0, NUM_PADDED)
    offs_d = tl.arange(0, HALF_PADDED)
    mask = (offs_h < NUM)[:, None] & (offs_d < HALF)[None, :]
    first_ptr = ptr + offs_h[:, None] * stride_head + offs_d[None, :]
    x1 = tl.load(first_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    y1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(ptr.dtype.element_ty)
    y2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(ptr.dtype.element_ty)
    tl.store(first_ptr, y1, mask=mask)
    tl.store(first_ptr + HALF, y2, mask=mask)
    return y1, y2


@triton.jit
def _rotary_kv_write_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens] int64
    slot_mapping_ptr,  # [num_tokens] int64
    cos_ptr,  # [max_position, rotary_dim]
    sin_ptr,  # [max_position, rotary_dim]
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos_pos,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    inv_k_scale,
    inv_v_scale,
    NUM_HEADS: tl.constexpr,
    NUM_HEADS_PADDED: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_half = tl.arange(0, HALF_PADDED)
    cos = tl.load(cos_ptr + pos * stride_cos_pos + offs_half, mask=offs_half < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos_pos + offs_half, mask=offs_half < HALF, other=0.0).to(tl.float32)
    k_row_ptr = key_ptr + token * stride_k_token
    _rotate_rows(
        query_ptr + token * stride_q_token, stride_q_head, cos, sin, NUM_HEADS, NUM_HEADS_PADDED, HALF, HALF_PADDED
    )
    k1, k2 = _rotate_rows(k_row_ptr, stride_k_head, cos, sin, NUM_KV_HEADS, NUM_KV_HEADS_PADDED, HALF, HALF_PADDED)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cache_row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot  # int64
    # Rotated k goes to the cache from registers (no re-read of what this program just stored).
    offs_h = tl.arange(0, NUM_KV_HEADS_PADDED)
    half_mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_half < HALF)[None, :]
    half_offs = cache_row + offs_h[:, None] * stride_cache_head + offs_half[None, :]
    k_dtype = key_cache_ptr.dtype.element_ty
    tl.store(key_cache_ptr + half_offs, (k1.to(tl.float32) * inv_k_scale).to(k_dtype), mask=half_mask)
    tl.store(key_cache_ptr + half_offs + HALF, (k2.to(tl.float32) * inv_k_scale).to(k_dtype), mask=half_mask)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    cache_offs = cache_row + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    if 2 * HALF < HEAD_DIM:  # partially rotary: the unrotated tail of k
        tail_mask = mask & (offs_d >= 2 * HALF)[None, :]
        key_tail = tl.load(k_row_ptr + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=tail_mask)
        tl.store(key_cache_ptr + cache_offs, (key_tail.to(tl.float32) * inv_k_scale).to(k_dtype), mask=tail_mask)
    value = tl.load(
        value_ptr + token * stride_v_token + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask
    ).to(tl.float32)
    tl.store(value_cache_ptr + cache_offs, (value * inv_v_scale).to(value_cache_ptr.dtype.element_ty), mask=mask)


def rotary_write_kv_cache(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_cache: torch.Tensor,  # [max_position, rotary_dim]
    sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding token
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rotary_dim = cos_cache.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and sin_cache.shape == cos_cache.shape
    assert kv_cache.shape[3:] == key.shape[1:] and value.shape == key.shape
    assert query.stride(2) == 1 and key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1
    assert cos_cache.stride(1) == 1 and cos_cache.stride(0) == sin_cache.stride(0)
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    half = rotary_dim // 2
    num_elements = next_power_of_2(num_heads) * next_power_of_2(head_dim)
    _rotary_kv_write_kernel[(num_tokens,)](
        query,
        key,
        value,
        key_cache,
        value_cache,
        positions,
        slot_mapping,
        cos_cache,
        sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos_cache.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_HEADS=num_heads,
        NUM_HEADS_PADDED=next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PADDED=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
        HALF=half,
        HALF_PADDED=next_power_of_2(half),
        BLOCK_SIZE=block_size_of(kv_cache),
        num_warps=4 if num_elements >= 2048 else 1 if num_elements <= 256 else 2,
        **pdl.launch(query.device),
    )


def block_size_of(kv_cache: torch.Tensor) -> int:
    return int(kv_cache.shape[2])
