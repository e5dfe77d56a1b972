"""The backend as the engine calls it: write this step's K/V, then attend, vs the reference backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.paged_batch import make_paged_batch, step_qkv
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


@pytest.mark.parametrize(
    ("window", "has_sinks", "softcap"), [(None, False, 2.0), (9, False, None), (None, True, None), (9, True, 2.0)]
)
def test_windowed_sink_and_capped_prefills_take_the_prefill_kernel(
    device: torch.device, monkeypatch: pytest.MonkeyPatch, window: int | None, has_sinks: bool, softcap: float | None
) -> None:
    """A prefill-heavy step with its new K/V at hand goes to the prefill kernel, features and all (the torch path
    is the oracle)."""
    from pagedserve.kernels import triton_backend
    from pagedserve.kernels.launch_config import uses_prefill_kernel
    from pagedserve.services.engine.torch_attention import paged_attention_padded

    batch = make_paged_batch(
        [70, 40], [70, 52], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device=device
    )
    assert uses_prefill_kernel(num_tokens=batch.num_tokens, num_seqs=2, max_query_len=batch.max_query_len)
    meta = attention.AttentionMetadata(
        slot_mapping=batch.slot_mapping,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
    )
    sinks = torch.linspace(-1.0, 2.0, 4, device=device) if has_sinks else None
    calls: list[dict[str, object]] = []
    prefill = triton_backend.prefill_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "prefill_attention", spy)
    query, key, value = step_qkv(batch)
    got = triton_backend.attend(
        query, batch.kv_cache, meta, 0.5, key=key, value=value, window=window, sinks=sinks, softcap=softcap
    )
    assert len(calls) == 1 and calls[0]["window"] == window and calls[0]["softcap"] == softcap
    assert calls[0]["sinks"] is sinks
    expected = paged_attention_padded(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.max_query_len,
        batch.max_seq_len,
        0.5,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_engine_entry_soft_caps_on_triton(device: torch.device, restore_backend: None) -> None:
    """attention.paged_attention hands a soft-capped layer to the Triton backend: same as the torch backend."""
    batch = make_paged_batch(
        [1, 9, 5],
        [30, 9, 21],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
        device=device,
        seed=13,
    )
    new_kv = torch.randn((2, batch.num_tokens, 2, 32), generator=torch.Generator().manual_seed(14)).to(device)
    meta = attention.AttentionMetadata(
        slot_mapping=batch.slot_mapping,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
    )
    outputs = []
    for name in ("torch", "triton"):
        attention.use_backend(name)
        cache = batch.kv_cache.clone()
        k, v = new_kv[0].to(torch.float16), new_kv[1].to(torch.float16)
        outputs.append(attention.paged_attention(batch.query, k, v, cache, meta, 0.5, window=6, softcap=2.0))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-3, rtol=2e-3)
