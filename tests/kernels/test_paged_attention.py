"""Kernel vs `pagedserve.kernels.reference` on small ragged mixes (interpreter on CPU: fp32/fp16 only)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels import reference
from pagedserve.kernels.launch_config import AttentionConfig, choose_config, decode_rows_fixed
from pagedserve.kernels.paged_attention import paged_attention
from pagedserve.kernels.paged_batch import PagedBatch, make_paged_batch

# (query_lens, seq_lens): decode, prompt, prompt after a cached prefix, chunked-prefill piece,
# a one-token prompt and a sequence with no query this step.
MIXED = ([1, 9, 5, 20, 1, 0], [37, 9, 21, 52, 1, 12])


def _run(batch: PagedBatch, config: AttentionConfig) -> torch.Tensor:
    head_dim = batch.query.shape[2]
    scale = head_dim**-0.5
    expected = reference.paged_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    out = torch.full_like(batch.query, float("nan"))  # poisoned: every row must be written
    result = paged_attention(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        config,
        out=out,
    )
    assert result is out
    assert not out.isnan().any()
    tol = 1e-4 if batch.query.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    return out


def _default(batch: PagedBatch, num_sms: int = 1) -> AttentionConfig:
    return choose_config(
        num_seqs=batch.seq_lens.shape[0],
        num_heads=batch.query.shape[1],
        num_kv_heads=batch.kv_cache.shape[3],
        head_dim=batch.query.shape[2],
        max_query_len=batch.max_query_len,
        num_sms=num_sms,
    )


@pytest.mark.parametrize(
    ("heads", "head_dim", "block_size", "dtype"),
    [
        ((4, 2), 32, 16, torch.float32),
        ((6, 2), 64, 32, torch.float16),  # group of 3: rows padded inside the tile
        ((4, 4), 40, 16, torch.float32),  # MHA, head_dim not a power of two
        ((8, 1), 32, 32, torch.float16),  # MQA
    ],
)
def test_mixed_batch(
    device: torch.device, heads: tuple[int, int], head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    batch = make_paged_batch(
        *MIXED,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    _run(batch, _default(batch))


@pytest.mark.parametrize(
    "config",
    [
        # Key tiles smaller than a cache block, and query blocks smaller than a prompt.
        AttentionConfig(block_m=16, tile_n=16, num_segments=1, num_warps=4, num_stages=2, is_decode_only=False),
        # Key tiles spanning several cache blocks, with split-KV over a mixed batch.
        AttentionConfig(block_m=32, tile_n=64, num_segments=4, num_warps=4, num_stages=2, is_decode_only=False),
    ],
)
def test_mixed_batch_tilings(device: torch.device, config: AttentionConfig) -> None:
    batch = make_paged_batch(
        *MIXED,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=32,
        dtype=torch.float32,
        device=device,
        seed=3,
    )
    _run(batch, config)


@pytest.mark.parametrize("num_segments", [1, 4])
def test_decode_only_batch(device: torch.device, num_segments: int) -> None:
    seq_lens = [1, 15, 16, 17, 130]  # block edges, a lone token, and more segments than tiles
    batch = make_paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
        device=device,
        seed=5,
    )
    config = _default(batch).with_(num_segments=num_segments, tile_n=16)
    assert config.is_decode_only
    _run(batch, config)


# The issue-13 key-loop variants (AttentionConfig fields), alone and in the combinations the sweep tries.
VARIANTS = [
    {"prefetch": 1},
    {"prefetch": 2, "num_stages": 1},
    {"prefetch": 1, "late_v": True, "evict_kv": True},
    {"loop_stages": 3, "unroll": 2},
    {"use_dot": False},
    {"use_dot": False, "prefetch": 2, "loop_stages": 2},
    {"persistent_programs": 7, "prefetch": 1},
    {"persistent_programs": 3, "use_dot": False, "num_segments": 1},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
def test_decode_variants(device: torch.device, variant: dict[str, int | bool]) -> None:
    # Block edges, a lone token, a sequence with no query this step, and segments without tiles.
    seq_lens = [1, 15, 16, 17, 130, 64]
    batch = make_paged_batch(
        [1, 1, 1, 1, 1, 0],
        seq_lens,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
        device=device,
        seed=11,
    )
    config = decode_rows_fixed(_default(batch).with_(num_segments=4, tile_n=16).with_(**variant), group=3)
    assert config.is_decode_only and config.block_m == (16 if config.use_dot else 4)
    _run(batch, config)


# The no-dot path is decode-only: on an H100 it missed the reference on this mixed batch (fp32, 1.2e-3).
@pytest.mark.parametrize("variant", [{"prefetch": 1}, {"prefetch": 2, "late_v": True}], ids=str)
def test_mixed_batch_variants(device: torch.device, variant: dict[str, int | bool]) -> None:
    # Prompts have several masked (diagonal) tiles after the full ones: prefetch must stop at the right tile.
    batch = make_paged_batch(
        *MIXED,
        num_heads=4,
        num_kv_heads=1,
        head_dim=40,
        block_size=16,
        dtype=torch.float32,
        device=device,
        seed=13,
    )
    _run(batch, _default(batch).with_(tile_n=16, block_m=16, **variant))


def test_output_is_independent_of_the_tiling(device: torch.device) -> None:
    batch = make_paged_batch(
        [3, 1, 40],
        [50, 33, 40],
        num_heads=4,
        num_kv_heads=1,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        device=device,
        seed=7,
    )
    first = _run(batch, _default(batch))
    other = _run(batch, _default(batch).with_(block_m=64, tile_n=32, num_segments=2))
    torch.testing.assert_close(first, other, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("window", "has_sinks", "config_change"),
    [
        (7, False, {}),  # windows cut into tiles and cache blocks; whole tiles before them are skipped
        (None, True, {}),
        (20, True, {"num_segments": 4, "tile_n": 16}),  # split-KV: the sink joins segment 0 only
        (5, True, {"num_segments": 1, "block_m": 16, "tile_n": 16}),
        # Windows past a tile: cut tiles (masked), then whole ones (unmasked, through the prefetch loops).
        (24, True, {"prefetch": 2, "num_stages": 1, "block_m": 16, "tile_n": 16}),
        (24, False, {"prefetch": 1, "block_m": 16, "tile_n": 16}),
    ],
)
def test_sliding_window_and_sinks_match_the_torch_path(
    device: torch.device, window: int | None, has_sinks: bool, config_change: dict[str, int]
) -> None:
    from pagedserve.services.engine.torch_attention import paged_attention_padded

    batch = make_paged_batch(
        *MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device=device, seed=17
    )
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)).to(device) * 3 if has_sinks else None
    expected = paged_attention_padded(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.max_query_len,
        batch.max_seq_len,
        0.2,
        window=window,
        sinks=sinks,
    )
    config = _default(batch).with_(**config_change)
    got = paged_attention(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        0.2,
        config,
        window=window,
        sinks=sinks,
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [9, 40])
@pytest.mark.parametrize("num_segments", [1, 4])
def test_decode_with_window_and_sinks(device: torch.device, num_segments: int, window: int) -> None:
    from pagedserve.services.engine.torch_attention import paged_attention_padded

    seq_lens = [1, 15, 16, 17, 130]
    batch = make_paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
        device=device,
        seed=5,
    )
    sinks = torch.linspace(-2, 4, 6, device=device)
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    expected = paged_attention_padded(*args, 1, batch.max_seq_len, 0.2, window=window, sinks=sinks)
    config = _default(batch).with_(num_segments=num_segments, tile_n=16)
    got = paged_attention(*args, 0.2, config, window=window, sinks=sinks)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-3, rtol=2e-3)


def _torch_path(batch: PagedBatch, scale: float, window: int | None, softcap: float | None = None) -> torch.Tensor:
    from pagedserve.services.engine.torch_attention import paged_attention_padded

    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    return paged_attention_padded(*args, batch.max_query_len, batch.max_seq_len, scale, window=window, softcap=softcap)


# A cap well inside the logits' range, so the tanh bends them (scale 0.5 on unit-variance q, k: |logit| up to ~10).
SOFTCAP = 2.0


@pytest.mark.parametrize(
    ("window", "dtype", "config_change"),
    [
        (None, torch.float32, {}),
        (7, torch.float32, {}),  # a window as well: the cap comes before the mask
        (None, torch.float16, {"num_segments": 4, "tile_n": 16}),  # split-KV over a mixed batch
        (24, torch.float16, {"prefetch": 2, "num_stages": 1, "block_m": 16, "tile_n": 16}),  # unmasked tiles too
    ],
)
def test_softcap_matches_the_torch_path(
    device: torch.device, window: int | None, dtype: torch.dtype, config_change: dict[str, int]
) -> None:
    """Prompts, a prompt after a cached prefix, a chunk and decodes; GQA (2 query heads per KV head)."""
    batch = make_paged_batch(
        *MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype, device=device, seed=19
    )
    expected = _torch_path(batch, 0.5, window=window, softcap=SOFTCAP)
    config = _default(batch).with_(**config_change)
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    got = paged_attention(*args, 0.5, config, window=window, softcap=SOFTCAP)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    uncapped = _torch_path(batch, 0.5, window=window)
    assert (uncapped.float() - expected.float()).abs().max() > 0.1, "the cap must matter in this test"


@pytest.mark.parametrize("variant", [{"num_segments": 1}, {"num_segments": 4}, {"num_segments": 4, "use_dot": False}])
@pytest.mark.parametrize("window", [None, 40])
def test_softcap_on_long_decodes(device: torch.device, variant: dict[str, int | bool], window: int | None) -> None:
    seq_lens = [1, 17, 130, 300]  # 300: many tiles per segment
    batch = make_paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
        device=device,
        seed=23,
    )
    expected = _torch_path(batch, 0.5, window=window, softcap=SOFTCAP)
    config = decode_rows_fixed(_default(batch).with_(tile_n=16).with_(**variant), group=3)
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    got = paged_attention(*args, 0.5, config, window=window, softcap=SOFTCAP)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-3, rtol=2e-3)


def test_softcap_saturates_without_nan(device: torch.device) -> None:
    """Logits far past the cap (|logit| ~ 1e4): tanh must give +-1, not inf / inf."""
    batch = make_paged_batch(
        [3, 1], [20, 33], num_heads=2, num_kv_heads=1, head_dim=32, block_size=16, dtype=torch.float32, device=device
    )
    expected = _torch_path(batch, 2000.0, None, SOFTCAP)
    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    got = paged_attention(*args, 2000.0, _default(batch), softcap=SOFTCAP)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_a_batch_padded_to_a_graph_shape(device: torch.device) -> None:
    """A mixed step padded to a captured graph's shape (cuda_graphs.py): tokens past the last sequence and
    sequences with no tokens and no context. The real rows are as unpadded; the padding costs programs that
    exit, not results."""
    batch = make_paged_batch(
        *MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device=device
    )
    unpadded = _run(batch, _default(batch))
    num_pad_tokens, num_pad_seqs = 13, 5
    query = torch.cat([batch.query, torch.randn_like(batch.query[:num_pad_tokens])])
    end = batch.query_start_loc[-1:]
    starts = torch.cat([batch.query_start_loc, end.repeat(num_pad_seqs)])
    seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(num_pad_seqs)])
    tables = torch.cat([batch.block_tables, batch.block_tables.new_zeros(num_pad_seqs, batch.block_tables.shape[1])])
    out = torch.full_like(query, float("nan"))
    config = _default(batch).with_(num_segments=1)
    paged_attention(query, batch.kv_cache, starts, seq_lens, tables, 32**-0.5, config, out=out)
    torch.testing.assert_close(out[: batch.num_tokens], unpadded, atol=1e-5, rtol=1e-5)
    assert out[batch.num_tokens :].isnan().all()  # padding tokens belong to no sequence: never written
