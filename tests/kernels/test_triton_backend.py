"""The backend as the engine calls it: write this step's K/V, then attend, vs the reference backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.paged_batch import make_paged_batch
from pagedserve.services.engine import attention


@pytest.fixture
def restore_backend() -> Iterator[None]:
    before = attention.backend_name()
    yield
    attention.use_backend(before)


@pytest.mark.parametrize(("query_lens", "seq_lens"), [([1, 1, 1], [9, 40, 2]), ([1, 12, 4], [30, 12, 19])])
def test_write_then_attend_matches_reference_backend(
    device: torch.device, restore_backend: None, query_lens: list[int], seq_lens: list[int]
) -> None:
    batch = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
        device=device,
        seed=11,
    )
    gen = torch.Generator(device=device).manual_seed(12)
    new_kv = torch.randn((2, batch.num_tokens, 2, 32), generator=gen, device=device).to(torch.float16)
    meta = attention.AttentionMetadata(
        slot_mapping=batch.slot_mapping,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
    )
    outputs, caches = [], []
    for name in ("reference", "triton"):
        attention.use_backend(name)
        cache = batch.kv_cache.clone()
        outputs.append(attention.paged_attention(batch.query, new_kv[0], new_kv[1], cache, meta, 0.2))
        caches.append(cache)
    torch.testing.assert_close(caches[1], caches[0], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-3, rtol=2e-3)
