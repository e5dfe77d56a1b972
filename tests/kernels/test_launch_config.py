from __future__ import annotations

import pytest

from pagedserve.kernels import launch_config
from pagedserve.kernels.launch_config import (
    FP8_DECODE_TILE_N,
    MAX_SEGMENTS,
    AttentionConfig,
    choose_config,
    decode_rows_fixed,
    next_power_of_2,
)


def _decode(num_seqs: int, num_sms: int = 132, heads: tuple[int, int] = (32, 8), head_dim: int = 128):
    return choose_config(
        num_seqs=num_seqs,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        max_query_len=1,
        num_sms=num_sms,
    )


def test_next_power_of_2() -> None:
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 64, 80, 96, 129)] == [1, 1, 2, 4, 64, 128, 128, 256]


def test_small_decode_batches_split_kv_and_large_ones_do_not() -> None:
    small, large = _decode(2), _decode(4096)
    assert small.is_decode_only and large.is_decode_only
    assert 1 < small.num_segments <= MAX_SEGMENTS
    assert large.num_segments == 1
    # Fewer sequences never means fewer segments (flash-decoding exists for the small batch).
    segments = [_decode(n).num_segments for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert segments == sorted(segments, reverse=True)


def test_segments_are_powers_of_two_for_the_reduce_tile() -> None:
    for n in range(1, 300, 7):
        s = _decode(n, heads=(9, 3), head_dim=64).num_segments
        assert s & (s - 1) == 0


@pytest.mark.parametrize(("heads", "head_dim"), [((32, 8), 128), ((9, 3), 64), ((64, 1), 128), ((8, 8), 256)])
@pytest.mark.parametrize("max_query_len", [1, 5, 63, 64, 2048])
def test_every_program_holds_a_whole_head_group(heads: tuple[int, int], head_dim: int, max_query_len: int) -> None:
    cfg = choose_config(
        num_seqs=8,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        max_query_len=max_query_len,
        num_sms=132,
    )
    group = heads[0] // heads[1]
    assert cfg.block_m >= max(16, group) and cfg.block_m & (cfg.block_m - 1) == 0
    assert cfg.block_q(group) >= 1 and cfg.block_q(group) * group <= cfg.block_m
    assert cfg.tile_n % 16 == 0
    assert cfg.is_decode_only == (max_query_len == 1)


def test_prefill_uses_large_tiles() -> None:
    cfg = choose_config(num_seqs=8, num_heads=32, num_kv_heads=8, head_dim=128, max_query_len=2048, num_sms=132)
    assert cfg.block_m == 64 and cfg.num_segments == 1 and cfg.block_q(4) == 16 and not cfg.is_decode_only


def test_split_kv_matches_the_measured_best() -> None:
    # The H200 sweep: 64 x 8 programs ran fastest with 2 segments, 256 x 8 with 1-2, 32 x 3 with 8.
    assert _decode(64).num_segments == 2
    assert _decode(256).num_segments == 1
    assert _decode(32, heads=(9, 3), head_dim=64).num_segments == 8


def test_decode_prefetches_block_ids_only_where_measured_faster() -> None:
    # The H100 sweep (bench/kernels.py --sweep): prefetch at 2 stages won with one segment at head_dim 128;
    # with split-KV, and at head_dim 64, today's kernel stayed best.
    one_segment = AttentionConfig(
        block_m=16, tile_n=64, num_segments=1, num_warps=4, num_stages=2, is_decode_only=True, prefetch=1
    )
    assert _decode(4096) == one_segment
    assert _decode(64).prefetch == 0 and _decode(64).num_stages == 3
    assert _decode(32, heads=(9, 3), head_dim=64).prefetch == 0


def test_decode_variant_is_one_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_config, "DECODE_VARIANT", {"prefetch": 1, "use_dot": False})
    monkeypatch.setattr(launch_config, "PERSISTENT_PROGRAMS_PER_SM", 2)
    cfg = _decode(64)
    assert cfg.prefetch == 1 and not cfg.use_dot and cfg.persistent_programs == 264
    assert cfg.block_m == 4  # no MMA: the 4-head group is not padded to 16 rows
    assert _decode(8, heads=(9, 3), head_dim=64).block_m == 4
    assert decode_rows_fixed(cfg.with_(use_dot=True), group=4).block_m == 16


def test_prefill_kernel_takes_prefill_heavy_steps_only() -> None:
    from pagedserve.kernels.launch_config import uses_prefill_kernel

    assert uses_prefill_kernel(num_tokens=8 * 2048, num_seqs=8, max_query_len=2048)
    assert uses_prefill_kernel(num_tokens=16 * 512, num_seqs=16, max_query_len=512)
    # The benchmark's mixed shape (mostly decodes) stays on the paged kernel; so do decode graphs.
    assert not uses_prefill_kernel(num_tokens=2048 + 128, num_seqs=132, max_query_len=512)
    assert not uses_prefill_kernel(num_tokens=256, num_seqs=256, max_query_len=1)
    assert not uses_prefill_kernel(num_tokens=8 * 40, num_seqs=8, max_query_len=40)


def test_prefill_config_packs_gqa_rows_into_full_tiles() -> None:
    from pagedserve.kernels.launch_config import choose_prefill_config

    for heads, kv_heads, head_dim in ((32, 8, 128), (9, 3, 64), (8, 8, 64), (64, 1, 128), (8, 2, 256)):
        config = choose_prefill_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
        group = heads // kv_heads
        assert config.block_m >= config.heads_per_program(group) and config.block_q(group) >= 1
        assert config.pack_gqa == (group > 1 and head_dim > 64)


def test_fp8_cache_decode_tile_moves_the_same_bytes_per_load() -> None:
    # Split-KV (64 sequences): only the tile differs. One segment: bf16's block-id prefetch (measured on bf16
    # only) stays off on an fp8 cache.
    bf16, fp8 = (
        _decode(64),
        choose_config(
            num_seqs=64, num_heads=32, num_kv_heads=8, head_dim=128, max_query_len=1, num_sms=132, kv_dtype_bytes=1
        ),
    )
    assert fp8.tile_n == FP8_DECODE_TILE_N and fp8.tile_n % 16 == 0
    assert fp8.with_(tile_n=bf16.tile_n) == bf16
    one_segment = choose_config(
        num_seqs=256, num_heads=32, num_kv_heads=8, head_dim=128, max_query_len=1, num_sms=132, kv_dtype_bytes=1
    )
    assert one_segment.tile_n == FP8_DECODE_TILE_N and one_segment.prefetch == 0
    prefill = dict(num_seqs=8, num_heads=32, num_kv_heads=8, head_dim=128, max_query_len=2048, num_sms=132)
    assert choose_config(**prefill, kv_dtype_bytes=1) == choose_config(**prefill)  # prefill tiles unchanged


def _moe(num_tokens: int, **shape: int) -> launch_config.MoeConfig:
    layer = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768) | shape
    return launch_config.choose_moe_config(num_tokens=num_tokens, dtype="bfloat16", **layer)


def test_moe_configs_grow_with_rows_per_expert() -> None:
    assert _moe(1).block_m == 16  # decode: 8 assignments over 128 experts
    assert _moe(64).block_m == 16  # 4 rows per expert: more rows per block would be padding
    assert _moe(1024).block_m == 64
    assert _moe(4096).block_m == 128  # 256 rows per expert: prefill tiles
    assert _moe(64, num_experts=8, top_k=2).block_m == 32  # Mixtral: 16 rows per expert
    for n in (1, 3, 17, 200, 5000):
        cfg = _moe(n)
        assert all(v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_n, cfg.block_k)) and cfg.block_m >= 16
    assert _moe(33) == _moe(64)  # one bucket, one compiled kernel
    assert launch_config.moe_tokens_bucket(10**6) == 4096


def test_moe_tuned_table_overrides_defaults_per_shape_and_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    small = launch_config.MoeConfig(16, 128, 128, 1, 4, 4)
    large = launch_config.MoeConfig(64, 128, 64, 8, 8, 3)
    monkeypatch.setitem(launch_config.MOE_TUNED, (128, 8, 2048, 768, "bfloat16"), ((16, small), (256, large)))
    assert _moe(1) == small and _moe(16) == small
    assert _moe(17) == large and _moe(4096) == large  # the last entry serves larger batches
    assert _moe(1, intermediate=1536) != small  # another shape keeps the defaults
