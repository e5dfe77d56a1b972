"""FP8 kernels vs torch: the e4m3 KV cache with per-layer scales (kernels vs `pagedserve.kernels.reference` on the
same cache), and per-token activation quantisation for the fp8 linears.

The interpreter stores and loads float8 (checked here), so the Triton fp8 path runs on CPU too.
Unwritten cache slots hold NaN (e4m3fn has one): a kernel that reads past a context shows it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels import reference
from pagedserve.kernels.kv_write import write_kv_cache
from pagedserve.kernels.launch_config import AttentionConfig
from pagedserve.kernels.paged_attention import paged_attention
from pagedserve.kernels.paged_batch import PagedBatch, make_paged_batch
from pagedserve.kernels.rotary_kv_write import rotary_write_kv_cache
from pagedserve.services.engine.attention import AttentionMetadata, _torch_attend
from pagedserve.services.engine.models.rotary import RopeParams, RotaryEmbedding

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.25, 2.0
MIXED = ([1, 9, 5, 20, 1, 0], [37, 9, 21, 52, 1, 12])  # decode, prompt, prefix, chunk, 1-token, idle


def assert_fp8_equal(got: torch.Tensor, want: torch.Tensor, exact_on_gpu: bool = True) -> None:
    """Bitwise equal on CUDA. The Triton 3.x interpreter's fp32 -> e4m3 rounding differs from torch's:
    ties go away from zero (torch: to even), subnormals can land one step off, and a round-up that
    carries into the exponent drops the carry (31.07 becomes 16, not 32). Under it, elements may
    differ by one e4m3 step or by exactly that carry bug, and nothing else."""
    got, want = got.float(), want.float()
    differ = (got != want) & ~(got.isnan() & want.isnan())
    if (got.device.type == "cpu" or not exact_on_gpu) and bool(differ.any()):
        g, w = got[differ], want[differ]
        step = torch.exp2(torch.floor(torch.log2(w.abs())) - 3).clamp(min=2**-9)  # e4m3: 3 mantissa bits
        is_interpreter_rounding = ((g - w).abs() <= step) | (g == w / 2)
        assert bool(is_interpreter_rounding.all()), (g[~is_interpreter_rounding], w[~is_interpreter_rounding])
        assert float(differ.float().mean()) < 0.05
        return
    assert not bool(differ.any()), (got[differ], want[differ])


def _fp8_batch(dtype: torch.dtype, device: torch.device) -> tuple[PagedBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch = make_paged_batch(
        *MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, device=device, seed=4
    )
    full = batch.kv_cache
    fp8 = torch.stack([reference.to_cache(full[0], FP8, K_SCALE), reference.to_cache(full[1], FP8, V_SCALE)])
    return batch, full, fp8, batch.query.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # bf16: the dots run in fp16
@pytest.mark.parametrize("num_segments", [1, 4])
def test_paged_attention_reads_fp8_cache_like_reference(
    device: torch.device, dtype: torch.dtype, num_segments: int
) -> None:
    batch, full, fp8, query = _fp8_batch(dtype, device)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables, 32**-0.5)
    expected = reference.paged_attention(query, fp8, *args, k_scale=K_SCALE, v_scale=V_SCALE)
    config = AttentionConfig(
        block_m=16, tile_n=16, num_segments=num_segments, num_warps=4, num_stages=2, is_decode_only=False
    )
    out = torch.full_like(query, float("nan"))
    paged_attention(query, fp8, *args, config, out=out, k_scale=K_SCALE, v_scale=V_SCALE)
    assert not out.isnan().any()
    tol = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}[dtype]  # bf16: the output's rounding
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    # And the fp8 cache is a close stand-in for the full-precision one (e4m3: 3 mantissa bits).
    exact = reference.paged_attention(query.float(), full, *args)
    assert float((expected.float() - exact).norm() / exact.norm()) < 0.08


def test_torch_path_reads_fp8_cache_like_reference(device: torch.device) -> None:
    batch, _, fp8, query = _fp8_batch(torch.float32, device)
    meta = AttentionMetadata(
        batch.slot_mapping,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.max_query_len,
        batch.max_seq_len,
    )
    expected = reference.paged_attention(
        query, fp8, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.2, k_scale=K_SCALE, v_scale=V_SCALE
    )
    got = _torch_attend(query, fp8, meta, 0.2, K_SCALE, V_SCALE)
    rows = batch.query_start_loc[-1]
    torch.testing.assert_close(got[:rows], expected[:rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_write_quantises_like_reference(device: torch.device, dtype: torch.dtype) -> None:
    gen = torch.Generator(device=device).manual_seed(6)
    num_tokens, num_blocks, block_size = 23, 4, 16
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slots[[0, 7]] = -1
    key = (4 * torch.randn((num_tokens, 3, 40), generator=gen, device=device)).to(dtype)
    value = (4 * torch.randn((num_tokens, 3, 40), generator=gen, device=device)).to(dtype)
    cache = torch.full((2, num_blocks, block_size, 3, 40), float("nan"), device=device).to(FP8)
    expected = cache.clone()
    reference.write_kv_cache(key, value, expected, slots, K_SCALE, V_SCALE)
    write_kv_cache(key, value, cache, slots, K_SCALE, V_SCALE)
    assert_fp8_equal(cache, expected)
    assert not cache.view(2, -1, 3, 40)[:, slots[slots >= 0]].float().isnan().any()
    back = expected.view(2, -1, 3, 40)[0, slots[slots >= 0]].float() * K_SCALE  # the scheme's round trip
    assert float(((back - key[slots >= 0].float()).abs() / key.float().abs().max()).max()) < 2**-4


def test_rotary_kv_write_quantises_like_reference(device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(7)
    num_tokens, num_blocks, block_size, heads, kv_heads, dim = 13, 3, 16, 4, 2, 32
    rotary = RotaryEmbedding(RopeParams("default", 10000.0, dim), max_position=256)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:num_tokens]
    slots[4] = -1
    q = torch.randn((num_tokens, heads, dim), generator=gen, device=device)
    k = torch.randn((num_tokens, kv_heads, dim), generator=gen, device=device)
    v = torch.randn((num_tokens, kv_heads, dim), generator=gen, device=device)
    q_ref, k_ref = rotary(positions, q, k)
    expected = torch.full((2, num_blocks, block_size, kv_heads, dim), float("nan"), device=device).to(FP8)
    cache = expected.clone()
    reference.write_kv_cache(k_ref, v, expected, slots, K_SCALE, V_SCALE)
    cos, sin = rotary.caches_for(q)
    rotary_write_kv_cache(positions, q, k, v, cos, sin, cache, slots, K_SCALE, V_SCALE)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    # The kernel's fp32 rotation may differ from torch's in the last bit, enough to move a rounding tie.
    assert_fp8_equal(cache, expected, exact_on_gpu=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [96, 576, 4500])
def test_per_token_activation_quantisation_matches_torch(device: torch.device, dtype: torch.dtype, k: int) -> None:
    from pagedserve.kernels.fp8_quant import quantize_rows_fp8
    from pagedserve.services.engine.models.fp8 import quantize_rows

    x = (torch.randn((5, k), device=device) * torch.logspace(-2, 2, 5, device=device)[:, None]).to(dtype)
    x[3] = 0  # an all-zero token: a tiny scale, zeros out
    q, scale = quantize_rows_fp8(x)
    want_q, want_scale = quantize_rows(x)
    torch.testing.assert_close(scale, want_scale, atol=0, rtol=1e-6)
    assert_fp8_equal(q, want_q, exact_on_gpu=False)  # x * (1/scale) vs x / scale: one rounding apart
    assert not q.float().isnan().any() and float(q.float().abs().max()) <= 448


def test_decode_on_fp8_cache_with_the_chosen_tile(device: torch.device) -> None:
    """Decode-only batches on a 1-byte cache get their own tile (launch_config.FP8_DECODE_TILE_N): it must
    still match the reference on a poisoned cache (make_paged_batch builds it in e4m3, NaN where unowned)."""
    from pagedserve.kernels.launch_config import choose_config

    seq_lens = [1, 130, 257, 64]
    batch = make_paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        device=device,
        seed=5,
        kv_dtype=FP8,
    )
    assert batch.kv_cache.dtype == FP8 and batch.kv_cache.float().isnan().any()  # the poison survives e4m3
    config = choose_config(
        num_seqs=len(seq_lens), num_heads=8, num_kv_heads=2, head_dim=64, max_query_len=1, num_sms=4, kv_dtype_bytes=1
    )
    assert config.is_decode_only and config.num_segments > 1
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables, 64**-0.5)
    expected = reference.paged_attention(batch.query, batch.kv_cache, *args, k_scale=K_SCALE, v_scale=V_SCALE)
    out = paged_attention(batch.query, batch.kv_cache, *args, config, k_scale=K_SCALE, v_scale=V_SCALE)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-3, rtol=3e-3)
