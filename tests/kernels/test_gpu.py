"""bf16/fp16 kernel checks on a real GPU (skipped without CUDA); also runnable as a plain script.

Error measure: ||out - ref|| / ||ref|| against the fp32 torch reference, bounded by BF16_BOUND
(a few bf16 ulps: outputs and softmax weights are rounded to bf16, accumulation is fp32).
"""

from __future__ import annotations

import torch

try:
    import pytest
except ImportError:  # bare GPU machines: bench/gpu_check.sh runs this file as a script
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    pytestmark = pytest.mark.gpu
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    pytest.importorskip("triton")

from pagedserve.kernels import reference
from pagedserve.kernels.kv_write import write_kv_cache
from pagedserve.kernels.launch_config import KV_LOADS, AttentionConfig, choose_config, choose_prefill_config
from pagedserve.kernels.paged_attention import paged_attention
from pagedserve.kernels.paged_batch import PagedBatch, make_paged_batch, step_qkv
from pagedserve.kernels.prefill_attention import prefill_attention
from pagedserve.kernels.triton_backend import attend
from pagedserve.services.engine.attention import AttentionMetadata

BF16_BOUND = 1e-2
DEVICE = torch.device("cuda")
NUM_SMS = torch.cuda.get_device_properties(DEVICE).multi_processor_count

# (num_heads, num_kv_heads, head_dim, block_size)
SHAPES = [
    (32, 8, 128, 16),
    (32, 8, 128, 32),
    (9, 3, 64, 16),
    (9, 3, 64, 32),
    (8, 8, 64, 16),
    (16, 1, 128, 16),
    (32, 4, 128, 32),
    (12, 4, 80, 16),
    (16, 2, 96, 32),
    (8, 2, 256, 16),
    (64, 8, 128, 16),
]
MIXED = ([1, 300, 77, 1, 513, 1, 6], [4097, 300, 1000, 70, 2100, 1, 6])
DECODE_LENS = [1, 17, 511, 4096, 9000, 64, 3000, 128]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _config(batch: PagedBatch) -> AttentionConfig:
    return choose_config(
        num_seqs=batch.seq_lens.shape[0],
        num_heads=batch.query.shape[1],
        num_kv_heads=batch.kv_cache.shape[3],
        head_dim=batch.query.shape[2],
        max_query_len=batch.max_query_len,
        num_sms=NUM_SMS,
    )


def _check(batch: PagedBatch, config: AttentionConfig | None = None) -> float:
    scale = batch.query.shape[2] ** -0.5
    ref = reference.paged_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        config or _config(batch),
        out=out,
    )
    return rel_err(out, ref)


def test_bf16_many_shapes() -> None:
    failures = []
    for heads, kv_heads, head_dim, block_size in SHAPES:
        for name, (query_lens, seq_lens) in (("mixed", MIXED), ("decode", ([1] * 8, DECODE_LENS))):
            batch = make_paged_batch(
                query_lens,
                seq_lens,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                dtype=torch.bfloat16,
                device=DEVICE,
                seed=head_dim + heads,
            )
            err = _check(batch)
            if not err < BF16_BOUND:
                failures.append((heads, kv_heads, head_dim, block_size, name, err))
    assert not failures, failures


def test_fp16_and_forced_tilings() -> None:
    batch = make_paged_batch(
        *MIXED, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float16, device=DEVICE
    )
    base = _config(batch)
    configs = [base, base.with_(block_m=16, tile_n=16), base.with_(block_m=64, tile_n=32, num_segments=4)]
    errors = [_check(batch, c) for c in configs]
    assert max(errors) < BF16_BOUND / 4, errors  # fp16 has 3 more mantissa bits


def test_offsets_past_2_to_the_31() -> None:
    # K half of the cache: 600k blocks x 16 x 2 x 128 = 2.46e9 elements > 2^31; used blocks at the top.
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 128, 16, 600_000
    batch = make_paged_batch(
        [1, 40, 1],
        [3000, 40, 700],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        device=DEVICE,
        num_blocks=num_blocks,
    )
    lowest_used = int(batch.block_tables[batch.block_tables > 0].min())  # 0 = table padding
    assert lowest_used * block_size * kv_heads * head_dim > 2**31
    assert _check(batch) < BF16_BOUND
    # The write kernel at the same high slots: overwrite this step's K/V, compare with the reference.
    new_kv = torch.randn((2, batch.num_tokens, kv_heads, head_dim), device=DEVICE).to(torch.bfloat16)
    write_kv_cache(new_kv[0], new_kv[1], batch.kv_cache, batch.slot_mapping)
    flat = batch.kv_cache.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[:, batch.slot_mapping], new_kv)
    del batch, flat
    torch.cuda.empty_cache()


def test_cuda_graph_replay_as_contexts_grow() -> None:
    # Capture one decode step (fixed shapes and addresses), then replay it with longer contexts.
    heads, kv_heads, head_dim = 9, 3, 64
    full_lens = torch.tensor([5000, 100, 9, 2000, 64, 777], device=DEVICE)
    batch = make_paged_batch(
        [1] * 6,
        full_lens.tolist(),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    batch.seq_lens.copy_(full_lens - 8)
    meta = AttentionMetadata(batch.slot_mapping, batch.query_start_loc, batch.seq_lens, batch.block_tables, 1, 5000)
    scale = head_dim**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend(batch.query, batch.kv_cache, meta, scale)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(batch.query, batch.kv_cache, meta, scale)
    for grow in (0, 3, 8):
        batch.seq_lens.copy_(full_lens - 8 + grow)
        batch.query.normal_()
        graph.replay()
        ref = reference.paged_attention(
            batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
        )
        assert rel_err(out, ref) < BF16_BOUND, grow


# Prompts, a prompt after a cached prefix, chunks, a one-token prompt and decodes (prefill kernel).
PREFILL_MIXED = ([300, 77, 513, 1, 6, 1000, 1], [300, 1000, 2100, 1, 6, 1000, 4097])


def _check_prefill(batch: PagedBatch, **changes: int | bool | str) -> float:
    scale = batch.query.shape[2] ** -0.5
    ref = reference.paged_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    query, key, value = step_qkv(batch, pad_tokens=5)
    base = choose_prefill_config(num_heads=query.shape[1], num_kv_heads=key.shape[1], head_dim=query.shape[2])
    config = base.with_(**changes)
    out = torch.full_like(query, float("nan"))
    n = batch.num_tokens
    prefill_attention(
        query[:n],
        key,
        value,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        config,
        out=out[:n],
    )
    assert out[n:].isnan().all(), "wrote past the last sequence"
    return rel_err(out[:n], ref)


def test_prefill_kernel_bf16_shapes_and_loads() -> None:
    failures = []
    for heads, kv_heads, head_dim, block_size in SHAPES:
        batch = make_paged_batch(
            *PREFILL_MIXED,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=torch.bfloat16,
            device=DEVICE,
            seed=head_dim + heads,
        )
        for kv_load in KV_LOADS:
            for pack_gqa in (True, False):
                err = _check_prefill(batch, kv_load=kv_load, pack_gqa=pack_gqa)
                if not err < BF16_BOUND:
                    failures.append((heads, kv_heads, head_dim, block_size, kv_load, pack_gqa, err))
    assert not failures, failures


def test_prefill_kernel_warp_specialized() -> None:
    """tl.range(warp_specialize=True): it may not compile on every Triton/GPU pair, but must be right if it does."""
    batch = make_paged_batch(
        *PREFILL_MIXED,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    errors, unsupported = {}, {}
    for kv_load in KV_LOADS:
        try:
            errors[kv_load] = _check_prefill(batch, kv_load=kv_load, warp_specialize=True)
        except Exception as exc:  # a compile error: the sweep skips such variants too
            unsupported[kv_load] = f"{type(exc).__name__}: {str(exc)[:200]}"
    print("warp_specialize unsupported:", unsupported)
    assert all(err < BF16_BOUND for err in errors.values()), errors


# Prompts longer than the windows, prompts and chunks after cached prefixes the windows cut, a lone token.
PREFILL_WINDOWED = ([300, 77, 513, 1, 200], [300, 1000, 2100, 1, 700])
# (num_heads, num_kv_heads, head_dim, window, has sinks, softcap): gpt-oss 20b's local layers, Gemma 2's
# (head_dim 256; a cap of 2 so random logits bend), Mistral v0.1's window, and all three on a GQA shape.
FEATURE_CASES = [
    (64, 8, 64, 128, True, None),
    (16, 8, 256, 256, False, 2.0),
    (32, 8, 128, 1000, False, None),
    (12, 4, 80, 97, True, 2.0),
]


def test_prefill_kernel_window_sinks_softcap_bf16() -> None:
    """Windows (tiles skipped and cut), sinks and soft-capping in the prefill kernel vs the torch path (fp32)."""
    from pagedserve.services.engine.torch_attention import paged_attention_padded

    failures = []
    for heads, kv_heads, head_dim, window, has_sinks, softcap in FEATURE_CASES:
        batch = make_paged_batch(
            *PREFILL_WINDOWED,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            block_size=16,
            dtype=torch.bfloat16,
            device=DEVICE,
            seed=head_dim + window,
        )
        scale = head_dim**-0.5
        sinks = torch.linspace(-2.0, 3.0, heads, device=DEVICE).to(torch.bfloat16) if has_sinks else None
        features = {"window": window, "sinks": sinks, "softcap": softcap}
        args = (batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables)
        ref = paged_attention_padded(*args, batch.max_query_len, batch.max_seq_len, scale, **features)
        query, key, value = step_qkv(batch, pad_tokens=5)
        base = choose_prefill_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
        n = batch.num_tokens
        for kv_load in KV_LOADS:
            for pack_gqa in (True, False):
                out = torch.full_like(query, float("nan"))
                prefill_attention(
                    query[:n],
                    key,
                    value,
                    batch.kv_cache,
                    batch.query_start_loc,
                    batch.seq_lens,
                    batch.block_tables,
                    scale,
                    base.with_(kv_load=kv_load, pack_gqa=pack_gqa),
                    out=out[:n],
                    **features,
                )
                err = rel_err(out[:n], ref)
                if not (err < BF16_BOUND and out[n:].isnan().all()):
                    failures.append((heads, kv_heads, head_dim, window, has_sinks, softcap, kv_load, pack_gqa, err))
    assert not failures, failures


def test_attend_routes_prefill_with_new_kv() -> None:
    batch = make_paged_batch(
        [512, 300, 200],
        [512, 1324, 200],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    query, key, value = step_qkv(batch)
    meta = AttentionMetadata(
        batch.slot_mapping,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        batch.max_query_len,
        batch.max_seq_len,
    )
    scale = 128**-0.5
    ref = reference.paged_attention(
        query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    assert rel_err(attend(query, batch.kv_cache, meta, scale, key=key, value=value), ref) < BF16_BOUND


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            fn()
            print(f"PASS {name}")
