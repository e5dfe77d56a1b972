"""Prefill kernel (new K/V from the fused qkv rows, prefixes from the cache) vs `pagedserve.kernels.reference`.

The cache is NaN wherever no sequence owns it, the qkv buffer has NaN padding rows after the last
token, and the output starts as NaN: a kernel that reads a key too many, lets a padding row into a sum,
skips a row or writes past its sequence shows it. Interpreter on CPU: fp32/fp16, tiny shapes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels import reference
from pagedserve.kernels.paged_batch import PagedBatch, make_paged_batch, step_qkv
from pagedserve.kernels.prefill_attention import PrefillConfig, prefill_attention

# (query_lens, seq_lens): decode, prompt, prompt after a cached prefix, chunked-prefill piece,
# a one-token prompt and a sequence with no query this step.
MIXED = ([1, 9, 5, 20, 1, 0], [37, 9, 21, 52, 1, 12])
# Prompts only, lengths on and off the tile edges.
PROMPTS = ([37, 5, 32, 1, 17], [37, 5, 32, 1, 17])
PAD_TOKENS = 3


def _config(block_m: int = 32, block_n: int = 16, pack_gqa: bool = True, kv_load: str = "pointer") -> PrefillConfig:
    return PrefillConfig(
        block_m=block_m, block_n=block_n, num_warps=4, num_stages=2, pack_gqa=pack_gqa, kv_load=kv_load
    )


def _check(batch: PagedBatch, config: PrefillConfig, tol: float | None = None) -> torch.Tensor:
    scale = batch.query.shape[2] ** -0.5
    expected = reference.paged_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    query, key, value = step_qkv(batch, PAD_TOKENS)
    out = torch.full_like(query, float("nan"))  # rows past the last token must stay untouched
    result = prefill_attention(
        query[: batch.num_tokens],
        key,
        value,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        config,
        out=out[: batch.num_tokens],
    )
    assert result.data_ptr() == out.data_ptr()
    assert not out[: batch.num_tokens].isnan().any()
    assert out[batch.num_tokens :].isnan().all()
    if tol is None:
        tol = 1e-4 if batch.query.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out[: batch.num_tokens].float(), expected.float(), atol=tol, rtol=tol)
    return out[: batch.num_tokens]


@pytest.mark.parametrize(
    ("heads", "head_dim", "dtype"),
    [
        ((4, 1), 64, torch.float32),  # group of 4
        ((6, 2), 64, torch.float16),  # group of 3: packed rows padded inside the tile
        ((2, 2), 80, torch.float32),  # MHA, head_dim not a power of two
    ],
)
@pytest.mark.parametrize("pack_gqa", [True, False])
def test_mixed_batch(
    device: torch.device, heads: tuple[int, int], head_dim: int, dtype: torch.dtype, pack_gqa: bool
) -> None:
    batch = make_paged_batch(
        *MIXED,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        device=device,
    )
    _check(batch, _config(pack_gqa=pack_gqa))


@pytest.mark.parametrize("kv_load", ["pointer", "host_tma", "device_tma"])
def test_kv_loads_agree(device: torch.device, kv_load: str) -> None:
    batch = make_paged_batch(
        *MIXED,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        dtype=torch.float16,
        device=device,
        seed=2,
    )
    _check(batch, _config(kv_load=kv_load))


@pytest.mark.parametrize(
    "config",
    [
        _config(block_m=16, block_n=32, pack_gqa=False),  # a query block narrower than a key tile
        _config(block_m=64, block_n=16, pack_gqa=False, kv_load="host_tma"),  # several diagonal tiles
        _config(block_m=64, block_n=32, pack_gqa=True, kv_load="device_tma"),
    ],
)
def test_prompts_off_the_tile_edges(device: torch.device, config: PrefillConfig) -> None:
    batch = make_paged_batch(
        *PROMPTS,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=torch.float16,
        device=device,
        seed=3,
    )
    _check(batch, config)


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
    first = _check(batch, _config())
    other = _check(batch, _config(block_m=16, block_n=32, pack_gqa=False))
    torch.testing.assert_close(first, other, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_scales_only_the_cached_prefix(device: torch.device, dtype: torch.dtype) -> None:
    """The prefix comes from an e4m3 cache (K / k_scale, V / v_scale); the new keys come unquantised from
    qkv, so the oracle is the reference over a cache that holds the dequantised prefix and exact new K/V."""
    fp8, k_scale, v_scale = torch.float8_e4m3fn, 0.25, 2.0
    batch = make_paged_batch(
        *MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device=device, seed=4
    )
    exact = batch.kv_cache
    quantised = torch.stack([reference.to_cache(exact[0], fp8, k_scale), reference.to_cache(exact[1], fp8, v_scale)])
    oracle_cache = torch.stack(
        [reference.from_cache(quantised[0], k_scale), reference.from_cache(quantised[1], v_scale)]
    )
    oracle_flat, exact_flat = oracle_cache.view(2, -1, 2, 32), exact.view(2, -1, 2, 32)
    oracle_flat[:, batch.slot_mapping] = exact_flat[:, batch.slot_mapping]
    scale = 32**-0.5
    expected = reference.paged_attention(
        batch.query, oracle_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    query, key, value = step_qkv(batch, PAD_TOKENS)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out = prefill_attention(
        query[: batch.num_tokens],
        key,
        value,
        quantised,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        _config(),
        k_scale=k_scale,
        v_scale=v_scale,
    )
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_a_batch_padded_to_a_graph_shape(device: torch.device) -> None:
    """Padding sequences with no tokens and no context after the real ones (a mixed graph's shape,
    cuda_graphs.py): the real rows are as unpadded, the padding rows untouched."""
    batch = make_paged_batch(
        *PROMPTS, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, device=device
    )
    unpadded = _check(batch, _config())
    num_pad_seqs = 4
    query, key, value = step_qkv(batch, PAD_TOKENS)
    starts = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:].repeat(num_pad_seqs)])
    seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(num_pad_seqs)])
    tables = torch.cat([batch.block_tables, batch.block_tables.new_zeros(num_pad_seqs, batch.block_tables.shape[1])])
    out = torch.full_like(query, float("nan"))
    prefill_attention(
        query, key, value, batch.kv_cache, starts, seq_lens, tables, 64**-0.5, _config(), out=out
    )  # all rows, the PAD_TOKENS padding ones included
    torch.testing.assert_close(out[: batch.num_tokens], unpadded, atol=1e-5, rtol=1e-5)
    assert out[batch.num_tokens :].isnan().all()


# Windows, sinks and soft-capping: the oracle is the torch path (services/engine/torch_attention.py), which
# the paged kernel's tests use too. A cap well inside the logits' range (scale 0.5 on unit-variance q, k), so
# the tanh bends them.
SOFTCAP = 2.0
# Prompts 3x a window and off the tile edges, a prompt after a cached prefix the window cuts, a chunk after
# 60 cached tokens (whole prefix tiles behind the window), a one-token prompt and a decode.
WINDOWED = ([40, 9, 20, 33, 1, 1], [40, 9, 37, 93, 1, 30])


def _sinks(num_heads: int, device: torch.device) -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, num_heads, device=device)


def _check_features(
    batch: PagedBatch,
    config: PrefillConfig,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    poison_behind_window: bool = False,
) -> torch.Tensor:
    """Kernel vs the torch path, with the rows past the last token and the unwritten output poisoned as in
    `_check`. With poison_behind_window, every whole key tile of the cached prefix that lies before the
    first new token's window is NaN before the kernel runs: a kernel that loads such a tile (masking it
    instead of skipping it) gets 0 * NaN in its P @ V sum."""
    from pagedserve.services.engine.torch_attention import paged_attention_padded

    args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
    expected = paged_attention_padded(
        *args, batch.max_query_len, batch.max_seq_len, scale, window=window, sinks=sinks, softcap=softcap
    )
    query, key, value = step_qkv(batch, PAD_TOKENS)
    kv_cache = batch.kv_cache
    if poison_behind_window:
        assert window is not None
        kv_cache = kv_cache.clone()
        block_size = kv_cache.shape[2]
        starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
        num_poisoned = 0
        for i, seq_len in enumerate(lens):
            ctx_len = seq_len - (starts[i + 1] - starts[i])
            unseen = max(ctx_len - window + 1, 0) // config.block_n * config.block_n  # whole tiles no row sees
            for pos in range(unseen):
                kv_cache[:, int(batch.block_tables[i, pos // block_size]), pos % block_size] = float("nan")
            num_poisoned += unseen
        assert num_poisoned > 0, "the case must have whole prefix tiles behind the window"
    out = torch.full_like(query, float("nan"))
    prefill_attention(
        query[: batch.num_tokens],
        key,
        value,
        kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        config,
        out=out[: batch.num_tokens],
        window=window,
        sinks=sinks,
        softcap=softcap,
    )
    assert not out[: batch.num_tokens].isnan().any()
    assert out[batch.num_tokens :].isnan().all()
    tol = 1e-4 if batch.query.dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out[: batch.num_tokens].float(), expected.float(), atol=tol, rtol=tol)
    return out[: batch.num_tokens]


def _windowed_batch(dtype: torch.dtype, device: torch.device, seed: int = 21) -> PagedBatch:
    return make_paged_batch(
        *WINDOWED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=dtype, device=device, seed=seed
    )


@pytest.mark.parametrize(
    ("window", "config"),
    [
        (7, _config(block_m=32, block_n=16)),  # smaller than a tile: cut tiles only, the rest skipped
        (1, _config(block_m=32, block_n=16)),  # each row sees its own key only
        (24, _config(block_m=16, block_n=16, pack_gqa=False)),  # cut tiles, then whole ones unmasked
        (20, _config(block_m=64, block_n=32, kv_load="host_tma")),
        (13, _config(block_m=32, block_n=16, kv_load="device_tma")),
        (1000, _config()),  # wider than every sequence: as without a window
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window_matches_the_torch_path(
    device: torch.device, window: int, config: PrefillConfig, dtype: torch.dtype
) -> None:
    batch = _windowed_batch(dtype, device)
    _check_features(batch, config, 0.2, window=window, poison_behind_window=window < 1000)


def test_a_wide_window_equals_no_window(device: torch.device) -> None:
    batch = _windowed_batch(torch.float32, device)
    windowed = _check_features(batch, _config(), 32**-0.5, window=1000)
    plain = _check(batch, _config())
    torch.testing.assert_close(windowed, plain, atol=1e-5, rtol=1e-5)


def test_window_over_chunked_prefill_after_a_cached_prefix(device: torch.device) -> None:
    """One prompt in three chunks through the kernel, each after the cache the previous ones filled: the window
    reaches back into the cached chunks, and tiles wholly behind it are never read."""
    seq_len, window = 100, 18
    full = make_paged_batch(
        [seq_len], [seq_len], num_heads=6, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, device=device
    )
    for start, end in [(0, 37), (37, 70), (70, 100)]:
        chunk = PagedBatch(
            query=full.query[start:end],
            kv_cache=full.kv_cache,
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            block_tables=full.block_tables,
            slot_mapping=full.slot_mapping[start:end],
            max_query_len=end - start,
            max_seq_len=end,
        )
        _check_features(chunk, _config(block_m=32, block_n=16), 0.3, window=window, poison_behind_window=start > 0)


@pytest.mark.parametrize(
    ("window", "has_sinks", "softcap", "dtype", "config"),
    [
        (None, True, None, torch.float32, _config()),
        (None, True, None, torch.float16, _config(block_m=16, block_n=32, pack_gqa=False)),
        (None, None, SOFTCAP, torch.float32, _config()),
        (None, None, SOFTCAP, torch.float16, _config(block_m=64, block_n=16, kv_load="host_tma")),
        (9, True, None, torch.float32, _config(block_m=16, block_n=16)),  # gpt-oss: window and sinks
        (9, None, SOFTCAP, torch.float16, _config(block_m=32, block_n=16)),  # Gemma 2: window and cap
        (24, True, SOFTCAP, torch.float32, _config(block_m=16, block_n=16, pack_gqa=False)),
        (5, True, SOFTCAP, torch.float16, _config(kv_load="device_tma")),
    ],
)
def test_sinks_and_softcap_match_the_torch_path(
    device: torch.device,
    window: int | None,
    has_sinks: bool | None,
    softcap: float | None,
    dtype: torch.dtype,
    config: PrefillConfig,
) -> None:
    batch = _windowed_batch(dtype, device, seed=22)
    sinks = _sinks(4, device) if has_sinks else None
    got = _check_features(batch, config, 0.5, window=window, sinks=sinks, softcap=softcap)
    if softcap is not None:  # the cap must matter in this test
        from pagedserve.services.engine.torch_attention import paged_attention_padded

        args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
        uncapped = paged_attention_padded(
            *args, batch.max_query_len, batch.max_seq_len, 0.5, window=window, sinks=sinks
        )
        assert (uncapped.float() - got.float()).abs().max() > 0.1


def test_softcap_saturates_without_nan(device: torch.device) -> None:
    """Logits far past the cap (|logit| ~ 1e4), on the cached prefix and the new keys: tanh gives +-1."""
    batch = make_paged_batch(
        [20, 9], [20, 41], num_heads=2, num_kv_heads=1, head_dim=32, block_size=16, dtype=torch.float32, device=device
    )
    _check_features(batch, _config(block_n=16), 2000.0, softcap=SOFTCAP)


def test_fp8_cache_with_window_sinks_and_softcap(device: torch.device) -> None:
    """An e4m3 cache's k_scale is part of the capped logit, v_scale of the cached values only; tiles the window
    skips are never read."""
    fp8, k_scale, v_scale = torch.float8_e4m3fn, 0.25, 2.0
    batch = _windowed_batch(torch.float32, device, seed=23)
    exact = batch.kv_cache
    quantised = torch.stack([reference.to_cache(exact[0], fp8, k_scale), reference.to_cache(exact[1], fp8, v_scale)])
    oracle_cache = torch.stack(
        [reference.from_cache(quantised[0], k_scale), reference.from_cache(quantised[1], v_scale)]
    )
    oracle_flat, exact_flat = oracle_cache.view(2, -1, 2, 32), exact.view(2, -1, 2, 32)
    oracle_flat[:, batch.slot_mapping] = exact_flat[:, batch.slot_mapping]
    from pagedserve.services.engine.torch_attention import paged_attention_padded

    sinks, window = _sinks(4, device), 11
    expected = paged_attention_padded(
        batch.query,
        oracle_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.max_query_len,
        batch.max_seq_len,
        0.5,
        window=window,
        sinks=sinks,
        softcap=SOFTCAP,
    )
    query, key, value = step_qkv(batch, PAD_TOKENS)
    out = prefill_attention(
        query[: batch.num_tokens],
        key,
        value,
        quantised,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        0.5,
        _config(block_n=16),
        k_scale=k_scale,
        v_scale=v_scale,
        window=window,
        sinks=sinks,
        softcap=SOFTCAP,
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_windowed_batch_padded_to_a_graph_shape(device: torch.device) -> None:
    """Padding tokens and sequences (a mixed graph's shape) with every feature on: real rows as unpadded."""
    batch = _windowed_batch(torch.float32, device)
    sinks = _sinks(4, device)
    unpadded = _check_features(batch, _config(), 0.5, window=9, sinks=sinks, softcap=SOFTCAP)
    num_pad_seqs = 3
    query, key, value = step_qkv(batch, PAD_TOKENS)
    starts = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:].repeat(num_pad_seqs)])
    seq_lens = torch.cat([batch.seq_lens, batch.seq_lens.new_zeros(num_pad_seqs)])
    tables = torch.cat([batch.block_tables, batch.block_tables.new_zeros(num_pad_seqs, batch.block_tables.shape[1])])
    out = torch.full_like(query, float("nan"))
    prefill_attention(
        query,
        key,
        value,
        batch.kv_cache,
        starts,
        seq_lens,
        tables,
        0.5,
        _config(),
        out=out,
        window=9,
        sinks=sinks,
        softcap=SOFTCAP,
    )
    torch.testing.assert_close(out[: batch.num_tokens], unpadded, atol=1e-5, rtol=1e-5)
    assert out[batch.num_tokens :].isnan().all()
