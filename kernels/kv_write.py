"""Write a step's new K/V rows into the paged cache through the slot mapping.

One program per token copies all its KV heads: slot -> (block, offset) -> cache row

    slot 21, block_size 16  ->  block 1, offset 5  ->  kv_cache[:, 1, 5, :, :]

Slot -1 marks a padding token (CUDA-graph batches padded to a captured size): nothing is written.
Offsets are 64-bit because num_blocks * block stride passes 2^31 on large caches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.launch_config import next_power_of_2


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    inv_k_scale,  # 1 / k_scale: an fp8 cache stores K / k_scale
    inv_v_scale,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, NUM_KV_HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    key = tl.load(
        key_ptr + token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask
    )  # [NUM_KV_HEADS_PADDED, HEAD_DIM_PADDED]
    value = tl.load(
        value_ptr + token * stride_value_token + offs_h[:, None] * stride_value_head + offs_d[None, :],
        mask=mask,
    )
    cache_offs = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_slot
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )  # int64
    if IS_FP8:
        key = key.to(tl.float32) * inv_k_scale
        value = value.to(tl.float32) * inv_v_scale
    tl.store(key_cache_ptr + cache_offs, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offs, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding token
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = kv_cache.shape[2]
    assert kv_cache.shape[3:] == key.shape[1:] and value.shape == key.shape
    assert slot_mapping.shape == (num_tokens,)
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_elements = next_power_of_2(num_kv_heads) * next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PADDED=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        IS_FP8=kv_cache.dtype.itemsize == 1,
        num_warps=4 if num_elements >= 2048 else 1 if num_elements <= 256 else 2,
    )
