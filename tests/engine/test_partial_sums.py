"""Row-parallel partial sums finished inside the next RMSNorm (parallel/partial_sums.py), on CPU.

The GPU kernel (kernels/all_reduce_norm.py) needs peers' device memory; its result is checked against
`all_reduce_add_rms_norm_reference` on 2 GPUs (bench/custom_all_reduce.py --check-only, run by
tests/engine/test_custom_all_reduce_gpu.py). Here, in one process:

- the reference equals what the unfused path computes (all-reduce in rank order, then add + RMSNorm);
- the plumbing: a fused Llama whose o_proj / down_proj are split over two emulated ranks (this rank's half
  of the input features into the partial buffer, the peer's half kept aside) gives the unsplit model's
  logits; every partial is finished by a norm, and an aux hidden-state layer (EAGLE-3) sees whole streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from pagedserve.kernels.all_reduce_norm import all_reduce_add_rms_norm_reference
from pagedserve.services.engine import attention
from pagedserve.services.engine.models import fused_ops, load_model
from pagedserve.services.engine.models.layers import Attention, GatedMLP
from pagedserve.services.engine.parallel import partial_sums
from pagedserve.services.engine.parallel.linear import Part, RowParallelLinear
from pagedserve.services.engine.parallel.partial_sums import SymmetricPartials, buffer_size, half_size
from pagedserve.services.engine.parallel.state import ParallelContext, all_reduce_limits
from pagedserve.shared.config import ParallelConfig
from tests.models.paged_driver import PagedDriver
from tests.models.tiny_models import build_tiny_model

# The model test runs the fused Triton kernels: compiled where CUDA is, else under the interpreter (conftest).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CPU = torch.device("cpu")


def test_reference_is_the_rank_order_sum_then_add_rms_norm() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(5, 48, generator=gen).bfloat16() for _ in range(4)]
    residual = torch.randn(5, 48, generator=gen).bfloat16()
    weight = torch.randn(48, generator=gen).bfloat16()
    normed, new_residual = all_reduce_add_rms_norm_reference(parts, residual.clone(), weight, 1e-5)
    total = (parts[0].float() + parts[1].float() + parts[2].float() + parts[3].float()).bfloat16()
    want_residual = total + residual
    want_normed = fused_ops.rms_norm(want_residual, weight, 1e-5)
    assert torch.equal(new_residual, want_residual)
    torch.testing.assert_close(normed, want_normed, atol=1e-2, rtol=1e-2)


class _TwoRankPartials(SymmetricPartials):
    """This process plays rank 0 of 2: the peer's addend is stashed by the projection that made ours."""

    def __init__(self, max_bytes: int, device: torch.device = CPU) -> None:
        handle = SimpleNamespace(rank=0, world_size=2, buffer_ptrs_dev=None, signal_pad_ptrs_dev=None)
        buffer = torch.zeros(2 * half_size(max_bytes), dtype=torch.uint8, device=device)
        super().__init__(buffer, handle, max_bytes)
        self.peer: torch.Tensor | None = None
        self.written = 0
        self.halves: list[int] = []  # the half each finished partial was read from

    def _sum_add_norm(
        self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, half: int
    ) -> torch.Tensor:
        assert self.peer is not None and self.peer.shape == partial.shape, "a partial finished twice"
        self.halves.append(half)
        normed, new_residual = all_reduce_add_rms_norm_reference([partial, self.peer], residual, weight, eps)
        residual.copy_(new_residual)
        self.peer = None
        return normed

    def _barrier(self) -> None:
        pass  # no peer: `barriers` counts the launches settle() would make


class _SplitRowLinear(nn.Module):
    """A linear split by input features over the two emulated ranks (RowParallelLinear's contract)."""

    def __init__(self, linear: nn.Linear, partials: _TwoRankPartials) -> None:
        super().__init__()
        self.linear, self.partials = linear, partials
        self.split = linear.in_features // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        if not self.partials.fits(x.shape[0], w.shape[0], x.dtype):
            return self.linear(x)
        assert self.partials.peer is None, "a partial was overwritten before a norm summed it"
        slot = self.partials.slot(x.shape[0], w.shape[0], x.dtype)
        torch.mm(x[:, : self.split], w[:, : self.split].t(), out=slot)
        self.partials.peer = x[:, self.split :] @ w[:, self.split :].t()
        self.partials.written += 1
        return slot


@pytest.fixture
def fused_triton() -> Iterator[None]:
    previous_backend, previous_mode = attention.backend_name(), fused_ops.fusion_mode()
    attention.use_backend("triton")
    fused_ops.set_fusion("on")
    yield
    attention.use_backend(previous_backend)
    fused_ops.set_fusion(previous_mode)


@pytest.mark.usefixtures("fused_triton")
@pytest.mark.parametrize("aux_layers", [frozenset(), frozenset({1})], ids=["plain", "aux-layer-1"])
def test_split_projections_summed_in_the_norm_match_the_whole_model(aux_layers: frozenset[int], tmp_path: Path) -> None:
    build_tiny_model("llama-gqa-tied-llama3rope-sharded", tmp_path)
    model = load_model(tmp_path, dtype="fp32", device=DEVICE, show_progress=False)
    prompts = {0: [5, 9, 13, 40, 7], 1: [3, 3, 90]}
    model.aux_hidden_layers = aux_layers
    want = torch.cat(PagedDriver(model, block_size=8).step(prompts))
    want_aux = [h.clone() for h in model.aux_hidden_states]

    # room for the 8-token prefill but not for 64 rows: a larger batch takes the reduced path
    partials = _TwoRankPartials(max_bytes=8 * 64 * 4, device=DEVICE)
    for module in model.modules():
        if isinstance(module, Attention):
            module.o_proj = _SplitRowLinear(module.o_proj, partials)  # type: ignore[assignment]
        elif isinstance(module, GatedMLP):
            module.down_proj = _SplitRowLinear(module.down_proj, partials)  # type: ignore[assignment]
    partial_sums.register(partials)
    try:
        with partial_sums.forward_pass():
            got = torch.cat(PagedDriver(model, block_size=8).step(prompts))
        got_aux = model.aux_hidden_states
        num_layers = model.spec.num_layers
        # two per layer, less the MLP output an aux layer copies
        assert partials.written == partials.calls == 2 * num_layers - len(aux_layers)
        assert partials.peer is None
        # consecutive partials alternate halves (no end barrier in the kernel); an odd count ends in a barrier
        assert partials.halves == [i % 2 for i in range(partials.calls)]
        assert partials.barriers == partials.calls % 2
        big = {i: [4 + i] * 32 for i in range(2)}  # 64 rows: past the buffer, reduced as before
        before = partials.calls
        PagedDriver(model, block_size=8).step(big)
        assert partials.calls == before
    finally:
        partial_sums.unregister(partials)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(got_aux) == len(want_aux) == len(aux_layers)
    for g, w in zip(got_aux, want_aux, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_owner_of_finds_only_the_starts_of_the_halves_which_partials_alternate() -> None:
    partials = _TwoRankPartials(max_bytes=256)
    partial_sums.register(partials)
    try:
        slot = partials.slot(2, 8, torch.float32)
        assert partial_sums.owner_of(slot) is partials
        assert partial_sums.owner_of(slot.clone()) is None
        assert partial_sums.owner_of(partials.buffer[16:].view(torch.float32)) is None
        partials.peer = torch.zeros(2, 8)
        partials.finish_add_rms_norm(slot, torch.zeros(2, 8), torch.ones(8), 1e-5)
        second = partials.slot(2, 8, torch.float32)  # the other half: peers may still read the first
        assert second.data_ptr() == slot.data_ptr() + 256 and partial_sums.owner_of(second) is partials
        partials.settle()  # an odd count: a barrier, then the first half again
        assert partials.barriers == 1 and partials.slot(2, 8, torch.float32).data_ptr() == slot.data_ptr()
    finally:
        partial_sums.unregister(partials)
    assert partial_sums.owner_of(slot) is None
    assert partials.fits(8, 8, torch.float32) and not partials.fits(9, 8, torch.float32)
    assert not partials.fits(2, 8, torch.int32)


def test_row_parallel_linear_writes_its_partial_into_the_buffer_where_it_fits() -> None:
    gen = torch.Generator().manual_seed(3)
    ctx = ParallelContext(0, 1, torch.device("cpu"))  # one rank: forward's all-reduce is the identity
    ctx.partials = _TwoRankPartials(max_bytes=4 * 16 * 4)
    linear = RowParallelLinear(Part(full_size=8, start=0, size=8), 16, bias=False, ctx=ctx).requires_grad_(False)
    linear.weight.data = torch.randn(16, 8, generator=gen)
    x = torch.randn(4, 8, generator=gen)
    partial = linear.forward_partial(x)
    assert ctx.partials.holds(partial) and partial.shape == (4, 16)
    torch.testing.assert_close(partial, x @ linear.weight.t())
    too_big = linear.forward_partial(torch.randn(5, 8, generator=gen))  # 5 x 16 fp32 > 256 bytes
    assert not ctx.partials.holds(too_big)
    with_bias = RowParallelLinear(Part(8, 0, 8), 16, bias=True, ctx=ctx)  # the bias goes on after the sum
    assert with_bias.bias is not None
    with_bias.weight.data, with_bias.bias.data = linear.weight.data, torch.randn(16, generator=gen)
    summed = with_bias.forward_partial(x)
    assert not ctx.partials.holds(summed)
    torch.testing.assert_close(summed, x @ linear.weight.t() + with_bias.bias)
    ctx.partials = None
    assert not partial_sums.owner_of(linear.forward_partial(x))


def test_all_reduce_limits_follow_the_flags() -> None:
    assert all_reduce_limits(ParallelConfig()) == (0, 8 << 20, False)  # torch's kernels opt-in, the fusion on (pull)
    assert all_reduce_limits(ParallelConfig(custom_all_reduce_max_bytes=1 << 20, fused_all_reduce_max_bytes=0)) == (
        1 << 20,
        0,
        False,
    )
    off = ParallelConfig(disable_custom_all_reduce=True, custom_all_reduce_max_bytes=64, fused_all_reduce_push=True)
    assert all_reduce_limits(off) == (0, 0, True)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_pushing_adds_an_inbox_slot_per_rank_to_each_half(world_size: int) -> None:
    half = half_size(1000)
    assert buffer_size(1000, world_size, push=False) == 2 * half
    assert buffer_size(1000, world_size, push=True) == 2 * half + 2 * world_size * half
