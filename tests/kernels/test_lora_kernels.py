"""The Triton LoRA shrink/expand kernels against the torch reference (under TRITON_INTERPRET=1 on CPU).

A mixed batch: tokens of three slots and of the base model interleaved, ranks below the padded maximum,
slices of unequal widths (q/k/v-like), a slot with no tokens; base rows must stay untouched. The expand of
every slice in one launch must equal one launch per slice exactly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pagedserve.kernels import lora_reference

pytest.importorskip("triton")
from pagedserve.kernels import lora


def _grouping(token_slots: list[int], max_loras: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.tensor(token_slots)
    order = [t for s in range(max_loras) for t in range(len(token_slots)) if token_slots[t] == s]
    counts = torch.bincount(slots[slots >= 0], minlength=max_loras)
    starts = torch.zeros(max_loras + 1, dtype=torch.int32)
    starts[1:] = counts.cumsum(0)
    sorted_ids = torch.zeros(len(token_slots), dtype=torch.int32)
    sorted_ids[: len(order)] = torch.tensor(order, dtype=torch.int32)
    return sorted_ids, starts


@pytest.mark.parametrize("is_fused", [False, True], ids=["expand-per-slice", "expand-fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shrink_and_expand_match_the_reference(dtype: torch.dtype, is_fused: bool, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    max_loras, max_rank, hidden = 4, 16, 48
    slices = [40, 24, 24]  # fused q | k | v widths
    token_slots = [1, -1, 0, 1, 2, 2, -1, 0, 1, 2, 2, 0, -1, 1, 2, 0, 0, 1, 2]  # slot 3 idle
    num_tokens = len(token_slots)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    lora_a = torch.randn(max_loras, len(slices) * max_rank, hidden, generator=gen).to(dtype)
    lora_a[:, max_rank - 4 : max_rank] = 0  # q of rank 12 padded to 16 (zero rows), as the slots hold it
    lora_b = torch.randn(max_loras, sum(slices), max_rank, generator=gen).to(dtype) * 0.1
    y0 = torch.randn(num_tokens, sum(slices), generator=gen).to(dtype)
    sorted_ids, starts = _grouping(token_slots, max_loras)

    def run(impl, x, lora_a, lora_b, y, is_fused=False):
        shrunk = torch.zeros(num_tokens, len(slices) * max_rank, dtype=torch.float32, device=x.device)
        impl.lora_shrink(x, lora_a, shrunk, sorted_ids.to(x.device), starts.to(x.device))
        if is_fused:  # every slice in one launch, as LoRALinear runs it
            ends = tuple(itertools.accumulate(slices))
            impl.lora_expand(shrunk, lora_b, y, sorted_ids.to(x.device), starts.to(x.device), ends)
            return shrunk, y
        offset = 0
        for i, width in enumerate(slices):
            impl.lora_expand(
                shrunk[:, i * max_rank : (i + 1) * max_rank],
                lora_b[:, offset : offset + width],
                y[:, offset : offset + width],
                sorted_ids.to(x.device),
                starts.to(x.device),
            )
            offset += width
        return shrunk, y

    ref_shrunk, ref_y = run(lora_reference, x, lora_a, lora_b, y0.clone())
    got_shrunk, got_y = run(lora, x.to(device), lora_a.to(device), lora_b.to(device), y0.clone().to(device), is_fused)
    if is_fused:  # the same kernel math column by column as one launch per slice: equal bit for bit
        per_slice = run(lora, x.to(device), lora_a.to(device), lora_b.to(device), y0.clone().to(device))[1]
        assert torch.equal(got_y, per_slice)
        fused_reference = run(lora_reference, x, lora_a, lora_b, y0.clone(), is_fused=True)[1]
        assert torch.equal(fused_reference, ref_y)
    is_lora = torch.tensor(token_slots) >= 0
    # fp32 on CUDA: tl.dot runs in tf32 (10-bit mantissa), so it gets fp16's tolerance; exact on the interpreter
    tol = 1e-4 if dtype == torch.float32 and device.type == "cpu" else 3e-2
    torch.testing.assert_close(got_shrunk.cpu()[is_lora], ref_shrunk[is_lora], atol=tol, rtol=tol)
    torch.testing.assert_close(got_y.cpu(), ref_y, atol=tol, rtol=tol)
    assert torch.equal(got_y.cpu()[~is_lora], y0[~is_lora])  # base rows untouched
    assert not torch.allclose(ref_y[is_lora], y0[is_lora])  # the delta is not zero


def test_a_batch_without_adapter_tokens_changes_nothing(device: torch.device) -> None:
    """What a captured graph replays for a base-only step: every program returns at once."""
    x = torch.randn(5, 32, device=device)
    y = torch.randn(5, 32, device=device)
    shrunk = torch.full((5, 16), 7.0, device=device)
    sorted_ids = torch.zeros(5, dtype=torch.int32, device=device)
    starts = torch.zeros(3, dtype=torch.int32, device=device)
    lora.lora_shrink(x, torch.randn(2, 16, 32, device=device), shrunk, sorted_ids, starts)
    before = y.clone()
    lora.lora_expand(shrunk, torch.randn(2, 32, 16, device=device), y, sorted_ids, starts)
    assert torch.equal(y, before) and bool((shrunk == 7.0).all())


@pytest.mark.parametrize("token_slots", [[2], [0, -1, 2, 2, 0]], ids=["one-token", "decode-batch"])
def test_shrink_splits_a_long_k_for_decode_batches(token_slots: list[int], device: torch.device) -> None:
    """K = 1024 over 16 tiles: a decode batch's shrink runs 4 programs per row tile that add their partial
    sums (atomics) into the output, which must equal the reference; rows without an adapter are zeros."""
    gen = torch.Generator().manual_seed(1)
    max_loras, n, k = 3, 48, 1024
    assert lora._split_k(len(token_slots), k) == 4
    x = torch.randn(len(token_slots), k, generator=gen)
    lora_a = torch.randn(max_loras, n, k, generator=gen)
    sorted_ids, starts = _grouping(token_slots, max_loras)
    want = torch.zeros(len(token_slots), n)
    lora_reference.lora_shrink(x, lora_a, want, sorted_ids, starts)
    got = torch.full((len(token_slots), n), 7.0, device=device)  # stale contents: the split zeroes them first
    lora.lora_shrink(x.to(device), lora_a.to(device), got, sorted_ids.to(device), starts.to(device))
    is_lora = torch.tensor(token_slots) >= 0
    tol = 1e-4 if device.type == "cpu" else 3e-2
    torch.testing.assert_close(got.cpu()[is_lora], want[is_lora], atol=tol, rtol=tol)
    assert bool((got.cpu()[~is_lora] == 0).all())


def test_split_shrink_adds_into_a_zeroed_column_view_of_a_wider_buffer(device: torch.device) -> None:
    """LoRALinear's decode path: the shrink writes its columns of a step-wide workspace, zeroed once for every
    projection (`is_zeroed`: no memset of its own); the columns beside it stay as they were."""
    gen = torch.Generator().manual_seed(2)
    max_loras, n, k, token_slots = 2, 32, 1024, [1, -1, 0]
    x = torch.randn(len(token_slots), k, generator=gen)
    lora_a = torch.randn(max_loras, n, k, generator=gen)
    sorted_ids, starts = _grouping(token_slots, max_loras)
    want = torch.zeros(len(token_slots), n)
    lora_reference.lora_shrink(x, lora_a, want, sorted_ids, starts)
    workspace = torch.zeros(len(token_slots), 3 * n, device=device)
    workspace[:, 2 * n :] = 5.0
    view = workspace[:, n : 2 * n]
    lora.lora_shrink(x.to(device), lora_a.to(device), view, sorted_ids.to(device), starts.to(device), is_zeroed=True)
    tol = 1e-4 if device.type == "cpu" else 3e-2
    torch.testing.assert_close(view.cpu(), want, atol=tol, rtol=tol)
    assert bool((workspace[:, :n] == 0).all()) and bool((workspace[:, 2 * n :] == 5.0).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream and graph capture are CUDA's")
def test_lora_linear_overlaps_its_shrink_inside_a_captured_graph() -> None:
    """LoRALinear on CUDA forks each decode-sized shrink onto a side stream beside the base projection and joins
    before the expand; captured in a graph and replayed for a new mix of slots, it equals the torch reference."""
    from pagedserve.services.engine.lora.layers import LoRABatch, LoRALinear

    gen = torch.Generator().manual_seed(3)
    device, dtype, k, slices, max_loras, rank = torch.device("cuda"), torch.bfloat16, 1024, [(0, 256), (256, 64)], 3, 16
    base = torch.nn.Linear(k, 320, bias=False).to(device, dtype)

    def layer(batch: LoRABatch) -> LoRALinear:
        linear = LoRALinear(base, k, slices, max_loras, rank, batch, dtype, device)
        for slot in range(max_loras):
            for index, (_, width) in enumerate(slices):
                a, b = torch.randn(rank, k, generator=gen), torch.randn(width, rank, generator=gen) * 0.1
                linear.load_slice(slot, index, a.to(device, dtype), b.to(device, dtype))
        return linear

    kernel_batch = LoRABatch(8, max_loras, device)
    fast = layer(kernel_batch)
    kernel_batch.allocate_workspace()
    reference_batch = LoRABatch(8, max_loras, device, ops=lora_reference)
    slow = layer(reference_batch)
    slow.lora_a.copy_(fast.lora_a)
    slow.lora_b.copy_(fast.lora_b)
    assert kernel_batch.side_stream is not None
    x = torch.randn(4, k, generator=gen).to(device, dtype)
    kernel_batch.prepare(np.array([0, -1, 2, 2]))
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):  # compile the kernels before the capture
        fast(x)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fast(x)
    for token_slots in ([0, -1, 2, 2], [1, 1, -1, 0]):
        slots = np.array(token_slots)
        kernel_batch.prepare(slots)
        reference_batch.prepare(slots)
        graph.replay()
        torch.testing.assert_close(y, slow(x), atol=5e-2, rtol=2e-2)
