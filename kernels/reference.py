"""Torch reference of paged attention: the CPU serving path and the oracle for the Triton kernels.

KV cache layout (one tensor per layer):

    kv_cache  # [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)

A token's *slot* is `block_id * block_size + offset_in_block`. A sequence's block table lists its
block ids in order, so its token at absolute position p lives in slot
`block_table[p // block_size] * block_size + p % block_size`:

    positions   0 1 2 3 | 4 5 6 7 | 8 9
    block_table [  7    ,    2    ,  5 ]   (block_size 4)
    slots       28..31  |  8..11  | 20 21

A step's batch is ragged and flattened: the query tokens of sequence i are rows
`query_start_loc[i]:query_start_loc[i+1]` and are the *last* tokens of its context of length
`seq_lens[i]`, so query row j of sequence i sits at absolute position
`seq_lens[i] - query_len_i + j` and attends causally to keys at positions <= that. This one rule
covers prompts, prompts after a cached prefix, chunked-prefill pieces and single-token decodes.
"""

from __future__ import annotations

import torch


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding token, not written
    k_scale: float = 1.0,  # stored = value / scale (an fp8 cache's range), read back as stored * scale
    v_scale: float = 1.0,
) -> None:
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key, value = to_cache(key, kv_cache.dtype, k_scale), to_cache(value, kv_cache.dtype, v_scale)
    if kv_cache.dtype.itemsize == 1:  # index_copy_ has no float8 kernels: copy the bytes
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """K or V as the cache stores it: divided by its scale (fp32 math) when the cache is 8-bit."""
    if cache_dtype.itemsize == 1:
        return (x.float() * (1.0 / scale)).to(cache_dtype)
    return x.to(cache_dtype)


def from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:  # -> float32
    return x.float() * scale if x.dtype.itemsize == 1 else x.float()


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged context (fp32 math)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        num_q = q_end - q_start
        if num_q == 0:
            continue
        num_ctx_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_ctx_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]  # [seq_len, kvh, d]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[q_start:q_end].float()  # [num_q, h, d]
        k = from_cache(k, k_scale).repeat_interleave(group, dim=1)  # [seq_len, h, d]
        v = from_cache(v, v_scale).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [h, num_q, seq_len]
        q_pos = torch.arange(seq_len - num_q, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] > q_pos[:, None]  # [num_q, seq_len]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
