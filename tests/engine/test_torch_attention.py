"""The batched CPU attention path equals the per-sequence reference on ragged prefill/decode mixes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.attention_metadata import AttentionMetadata
from pagedserve.kernels.reference import paged_attention as reference_attention
from pagedserve.services.engine import attention
from pagedserve.services.engine.torch_attention import paged_attention_padded


def _ragged_batch(
    seed: int, block_size: int, num_heads: int, num_kv_heads: int, is_decode_only: bool
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(seed)
    head_dim, num_blocks, num_seqs = 16, 96, 6
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    seq_lens = torch.randint(1, 60, (num_seqs,), generator=gen)
    query_lens = (
        torch.ones_like(seq_lens)
        if is_decode_only
        else ((torch.rand(num_seqs, generator=gen) * seq_lens).long().clamp(min=1))
    )
    max_blocks = (int(seq_lens.max()) + block_size - 1) // block_size
    block_tables = torch.zeros(num_seqs, max_blocks + 2, dtype=torch.int32)  # wider than needed, like the runner's
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, not contiguous
    for i, n in enumerate(seq_lens.tolist()):
        for j in range((n + block_size - 1) // block_size):
            block_tables[i, j] = free.pop()
    query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(query_lens, 0)
    query = torch.randn(int(query_start_loc[-1]), num_heads, head_dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.int(),
        block_tables=block_tables,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return query, kv_cache, meta


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("is_decode_only", [True, False])
def test_batched_path_matches_the_reference(
    seed: int, num_heads: int, num_kv_heads: int, is_decode_only: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    query, kv_cache, meta = _ragged_batch(seed, 8, num_heads, num_kv_heads, is_decode_only)
    expected = reference_attention(query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3)
    whole = attention._torch_attend(query, kv_cache, meta, 0.3)
    monkeypatch.setattr(attention, "_MAX_PADDED_TOKENS", 70)  # forces one or two sequences per chunk
    chunked = attention._torch_attend(query, kv_cache, meta, 0.3)
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, expected, atol=1e-5, rtol=1e-5)


def test_unused_cache_slots_never_leak_into_the_output() -> None:
    query, kv_cache, meta = _ragged_batch(7, 8, 6, 2, is_decode_only=False)
    expected = reference_attention(query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3)
    used = torch.zeros(kv_cache.shape[1], kv_cache.shape[2], dtype=torch.bool)
    for i, n in enumerate(meta.seq_lens.tolist()):
        for pos in range(n):
            used[meta.block_tables[i, pos // 8], pos % 8] = True
    kv_cache[:, ~used] = float("nan")  # block tails and unused blocks, as in a fresh torch.empty cache
    out = attention._torch_attend(query, kv_cache, meta, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_backends_can_be_switched() -> None:
    attention.use_backend("reference")
    assert attention.backend_name() == "reference"
    attention.use_backend("torch")
    assert attention.backend_name() == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention.use_backend("nope")


def test_one_padded_call_matches_the_reference_per_sequence() -> None:
    """The CPU path's whole-batch kernel on its own (the backend above chunks batches into such calls)."""
    query, kv_cache, meta = _ragged_batch(3, 8, 6, 2, is_decode_only=False)
    expected = reference_attention(query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3)
    out = paged_attention_padded(
        query,
        kv_cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        meta.max_query_len,
        meta.max_seq_len,
        0.3,
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
