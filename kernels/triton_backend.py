"""The Triton attention backend, as the engine's `use_backend("triton")` loads it.

Only this module and the kernel modules import triton, so CPU machines without it never do.
Config choice is cached per batch shape and uses host integers only (no GPU sync): see
`pagedserve.kernels.launch_config` for what a CUDA graph needs to keep fixed. Prefill-heavy steps whose new K/V
the caller hands over (the fused rotary path) go to the prefill kernel; everything else, decode
graphs included, to the paged kernel. Both have sliding windows, attention sinks and logit soft-capping
(constexpr switches: layers without them compile and run as before), so the choice never depends on them.
"""

from __future__ import annotations

from functools import cache

import torch

from pagedserve.kernels.attention_metadata import AttentionMetadata
from pagedserve.kernels.kv_write import write_kv_cache
from pagedserve.kernels.launch_config import (
    PREFILL_QUERY_LEN,
    choose_config,
    choose_prefill_config,
    uses_prefill_kernel,
)
from pagedserve.kernels.paged_attention import paged_attention
from pagedserve.kernels.prefill_attention import prefill_attention

__all__ = ["attend", "write_kv_cache"]


@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: any value works, fewest segments is fastest
    return torch.cuda.get_device_properties(device).multi_processor_count


# Config choice depends on host integers only, so it is cached per batch shape.
_config = cache(choose_config)
_prefill_config = cache(choose_prefill_config)


def _is_token_rows(x: torch.Tensor, num_tokens: int) -> bool:
    """[num_tokens, num_kv_heads, head_dim] with each token's heads side by side (a view of qkv rows)."""
    return x.shape[0] >= num_tokens and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: this step's keys, already in
    value: torch.Tensor | None = None,  # the cache too; lets a prefill read them without the block table
    window: int | None = None,  # this layer's sliding window
    sinks: torch.Tensor | None = None,  # [num_heads] learned sink logits (gpt-oss)
    softcap: float | None = None,  # attention-logit soft-capping (Gemma 2)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = meta.seq_lens.shape[0]
    if (
        key is not None
        and value is not None
        and _is_token_rows(key, num_tokens)
        and _is_token_rows(value, num_tokens)
        and uses_prefill_kernel(num_tokens=num_tokens, num_seqs=num_seqs, max_query_len=meta.max_query_len)
    ):
        return prefill_attention(
            query,
            key,
            value,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            _prefill_config(num_heads=num_heads, num_kv_heads=kv_cache.shape[3], head_dim=head_dim),
            k_scale=k_scale,
            v_scale=v_scale,
            window=window,
            sinks=sinks,
            softcap=softcap,
        )
    config = _config(
        num_seqs=num_seqs,
        num_heads=num_heads,
        num_kv_heads=kv_cache.shape[3],
        head_dim=head_dim,
        max_query_len=min(meta.max_query_len, PREFILL_QUERY_LEN),  # the choice only looks at this bucket
        num_sms=_num_sms(query.device),
        kv_dtype_bytes=kv_cache.element_size(),
    )
    return paged_attention(
        query,
        kv_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        scale,
        config,
        k_scale=k_scale,
        v_scale=v_scale,
        window=window,
        sinks=sinks,
        softcap=softcap,
    )
