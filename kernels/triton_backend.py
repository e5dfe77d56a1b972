"""The Triton attention backend, as the engine's `use_backend("triton")` loads it.

Only this module and the kernel modules import triton, so CPU machines without it never do.
Config choice is cached per batch shape and uses host integers only (no GPU sync): see
`kernels.launch_config` for what a CUDA graph needs to keep fixed.
"""

from __future__ import annotations

from functools import cache

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_write import write_kv_cache
from kernels.launch_config import PREFILL_QUERY_LEN, AttentionConfig, choose_config
from kernels.paged_attention import paged_attention

__all__ = ["attend", "write_kv_cache"]


@cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: any value works, fewest segments is fastest
    return torch.cuda.get_device_properties(device).multi_processor_count


@cache
def _config(
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    num_sms: int,
    kv_dtype_bytes: int = 2,
) -> AttentionConfig:
    return choose_config(
        num_seqs=num_seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_query_len=max_query_len,
        num_sms=num_sms,
        kv_dtype_bytes=kv_dtype_bytes,
    )


def attend(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    config = _config(
        meta.seq_lens.shape[0],
        query.shape[1],
        kv_cache.shape[3],
        query.shape[2],
        min(meta.max_query_len, PREFILL_QUERY_LEN),  # the choice only looks at this bucket
        _num_sms(query.device),
        kv_cache.element_size(),
    )
    return paged_attention(query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, config,
                           k_scale=k_scale, v_scale=v_scale)  # fmt: skip
