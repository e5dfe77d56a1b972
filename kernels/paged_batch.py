"""Random ragged batches over a scattered, poisoned paged cache: shared by kernel tests and benchmarks.

Every cache entry that no sequence owns (free blocks, and the tail of each sequence's last block)
holds NaN, and unused block-table entries point at a free block, so a kernel that reads one key
too many returns NaN instead of a plausible number. Used blocks are spread over the top of the
block range, so a large `num_blocks` puts real data past the 2^31-element mark.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64: slots of the query tokens
    max_query_len: int
    max_seq_len: int

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]


def make_paged_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
) -> PagedBatch:
    """Sequence i has context seq_lens[i]; its last query_lens[i] tokens are this step's queries.

    `kv_dtype` (default `dtype`) may be float8_e4m3fn: the cache then holds the same random K/V rounded
    to e4m3 (scale 1: read it with k_scale = v_scale = 1), and its unowned entries e4m3's NaN."""
    assert len(query_lens) == len(seq_lens) and all(0 <= q <= s for q, s in zip(query_lens, seq_lens))
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_used = sum(blocks_per_seq)
    if num_blocks is None:
        num_blocks = num_used + 2
    assert num_blocks > num_used, "need one free block for the poisoned block-table padding"
    # Spread the used blocks over the top of the range (free block 0 stays the padding target).
    pool = min(num_blocks - 1, 2 * num_used + 8)
    perm = torch.randperm(pool, generator=gen, device=device)[:num_used] + (num_blocks - pool)
    max_blocks = max(1, *blocks_per_seq)
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32, device=device)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    kv_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.full(kv_shape, float("nan"), dtype=kv_dtype, device=device)
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    slot_chunks: list[torch.Tensor] = []
    start = 0
    for i, (num_q, seq_len) in enumerate(zip(query_lens, seq_lens)):
        ids = perm[start : start + blocks_per_seq[i]]
        start += blocks_per_seq[i]
        block_tables[i, : ids.numel()] = ids.to(torch.int32)
        positions = torch.arange(seq_len, device=device)
        slots = ids[positions // block_size].long() * block_size + positions % block_size
        values = torch.randn((2, seq_len, num_kv_heads, head_dim), generator=gen, device=device)
        flat[:, slots] = values.to(kv_dtype)
        slot_chunks.append(slots[seq_len - num_q :])
    query_lens_t = torch.tensor(list(query_lens), dtype=torch.int32, device=device)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = torch.cumsum(query_lens_t, 0)
    num_tokens = sum(query_lens)
    query = torch.randn((num_tokens, num_heads, head_dim), generator=gen, device=device).to(dtype)
    return PagedBatch(
        query=query,
        kv_cache=kv_cache,
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=torch.cat(slot_chunks) if slot_chunks else torch.zeros(0, dtype=torch.long),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
    )


def step_qkv(batch: PagedBatch, pad_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, key, value) of the step's tokens as the fused qkv projection hands them to attention: views
    into one [num_tokens + pad_tokens, (num_heads + 2 * num_kv_heads) * head_dim] buffer (token stride
    q_size + 2 * kv_size), keys/values copied from the cache at the query tokens' slots. The padding rows
    after the last token hold NaN, as rows that no sequence owns must never reach an output."""
    num_tokens, num_heads, head_dim = batch.query.shape
    num_kv_heads = batch.kv_cache.shape[3]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.full(
        (num_tokens + pad_tokens, q_size + 2 * kv_size),
        float("nan"),
        dtype=batch.query.dtype,
        device=batch.query.device,
    )
    flat = batch.kv_cache.view(2, -1, num_kv_heads, head_dim)
    query = qkv[:, :q_size].view(-1, num_heads, head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
    query[:num_tokens] = batch.query
    if num_tokens:
        key[:num_tokens] = flat[0, batch.slot_mapping].to(qkv.dtype)
        value[:num_tokens] = flat[1, batch.slot_mapping].to(qkv.dtype)
    return query, key, value
