"""The fused-MoE Triton kernel (interpreted on CPU, compiled on CUDA) against a per-token loop: fp32 and
fp16, SiLU and gpt-oss's biased clamped SwiGLU, softmax/sigmoid routing with and without renormalizing,
shapes that are not multiples of the tiles; unhit experts are never read; the MoE layer dispatches to it.
MXFP4 weights (4-bit codes + scales, dequantised in the kernel) against the same kernel on the dequantised
weights, and a hand-packed case."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.fused_moe import fused_experts
from pagedserve.kernels.launch_config import MoeConfig
from pagedserve.kernels.moe_align_triton import moe_align_block_size_triton
from pagedserve.services.engine import attention
from pagedserve.services.engine.models import fused_ops, mxfp4
from pagedserve.services.engine.models.moe import MoE, route
from tests.kernels.moe_cases import per_token_oracle, random_case
from tests.kernels.test_moe_align import check_alignment


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts", "block_m"),
    [(37, 2, 8, 16), (3, 2, 200, 16), (1, 4, 16, 16), (300, 4, 6, 32)],
)
def test_triton_alignment_is_valid(
    num_tokens: int, top_k: int, num_experts: int, block_m: int, device: torch.device
) -> None:
    """The one-program Triton alignment: same invariants as the torch one (rows inside a run unordered);
    200 experts pad to 256 lanes and several chunks of assignments."""
    gen = torch.Generator().manual_seed(num_tokens)
    topk_ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices.to(device)

    def align(ids: torch.Tensor, block: int, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.cpu() for t in moe_align_block_size_triton(ids, block, experts))  # type: ignore[return-value]

    check_alignment(topk_ids, block_m, num_experts, align=align, keeps_token_order=False)


_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize(
    ("dtype", "swiglu", "scoring", "renormalize", "config"),
    [
        # hidden 72 / intermediate 40: K tiles masked, N tiles wrapping past the end
        (torch.float32, False, "softmax", True, MoeConfig(16, 32, 32, 1, 4, 2)),
        (torch.float32, True, "sigmoid", False, MoeConfig(32, 16, 64, 4, 4, 2)),
        (torch.float16, False, "softmax", False, None),  # the config choose_moe_config gives
        (torch.float16, True, "softmax", True, MoeConfig(16, 32, 32, 2, 4, 2)),
    ],
    ids=["fp32-silu-softmax-renorm", "fp32-swiglu-bias-sigmoid", "fp16-silu-softmax-auto", "fp16-swiglu-bias-renorm"],
)
def test_fused_experts_equal_a_per_token_loop(
    dtype: torch.dtype, swiglu: bool, scoring: str, renormalize: bool, config: MoeConfig | None, device: torch.device
) -> None:
    case = random_case(13, 72, 40, 8, 2, scoring=scoring, renormalize=renormalize, swiglu=swiglu, dtype=dtype)
    expected = per_token_oracle(case)
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}
    args = [t.to(device) for t in (case.x, case.w13, case.w2, case.topk_weights, case.topk_ids)]
    out = fused_experts(*args, config=config, **on)
    assert out.dtype == dtype and out.shape == case.x.shape
    torch.testing.assert_close(out.float().cpu(), expected, **_TOL[dtype])


@pytest.mark.parametrize("align", ["triton", "torch"])
def test_unhit_experts_are_never_read(align: str, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only experts 1 and 5 are chosen; the others' weights are NaN, so reading any of them would show.
    Both alignments (the Triton one, and torch's that large batches take) feed the GEMMs."""
    from pagedserve.kernels import fused_moe

    if align == "torch":
        monkeypatch.setattr(fused_moe, "TRITON_ALIGN_MAX_ASSIGNMENTS", 8)
    case = random_case(20, 64, 32, 8, 2)
    case.topk_ids = torch.stack([torch.full((20,), 1), torch.full((20,), 5)], dim=1)
    for e in (0, 2, 3, 4, 6, 7):
        case.w13[e], case.w2[e] = float("nan"), float("nan")
    expected = per_token_oracle(case)
    args = [t.to(device) for t in (case.x, case.w13, case.w2, case.topk_weights, case.topk_ids)]
    out = fused_experts(*args, config=MoeConfig(16, 32, 64, 1, 4, 2))
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_one_token_decode(device: torch.device) -> None:
    """Batch-1 decode takes the no-sort layout (a block per slot); top-4 of 16, gpt-oss's activation."""
    case = random_case(1, 64, 32, 16, 4, swiglu=True)
    expected = per_token_oracle(case)
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}
    args = [t.to(device) for t in (case.x, case.w13, case.w2, case.topk_weights, case.topk_ids)]
    torch.testing.assert_close(fused_experts(*args, **on).cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("dtype", "swiglu", "num_tokens", "top_k", "config"),
    [
        # hidden 96 / intermediate 96: GEMM 1's N tiles wrap, both GEMMs' K tails are half a 64-wide tile
        (torch.float32, False, 13, 2, MoeConfig(16, 64, 64, 1, 4, 2)),
        (torch.float32, True, 1, 4, MoeConfig(16, 32, 32, 1, 4, 2)),  # decode: one token, BLOCK_K one group
        (torch.float32, True, 21, 3, MoeConfig(32, 32, 128, 2, 4, 2)),
        (torch.float16, True, 9, 4, None),  # the config choose_moe_config gives
        (torch.float16, False, 1, 2, MoeConfig(16, 32, 64, 1, 4, 2)),
    ],
    ids=[
        "fp32-silu-ragged-top2",
        "fp32-swiglu-decode-top4",
        "fp32-swiglu-ragged-top3",
        "fp16-swiglu-auto",
        "fp16-silu-decode",
    ],
)
def test_mxfp4_weights_equal_the_dequantised_weights(
    dtype: torch.dtype, swiglu: bool, num_tokens: int, top_k: int, config: MoeConfig | None, device: torch.device
) -> None:
    """The kernel's in-register dequantisation against the same kernel fed mxfp4.dequantize's dense weights."""
    case = random_case(num_tokens, 96, 96, 8, top_k, swiglu=swiglu, dtype=dtype, seed=num_tokens)
    (w13, w13_scale), (w2, w2_scale) = mxfp4.quantize_flat(case.w13), mxfp4.quantize_flat(case.w2)
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}
    x, weights, ids = (t.to(device) for t in (case.x, case.topk_weights, case.topk_ids))
    dense = (mxfp4.dequantize_flat(w, s, dtype).to(device) for w, s in ((w13, w13_scale), (w2, w2_scale)))
    expected = fused_experts(x, *dense, weights, ids, config=config, **on)
    packed = (t.to(device) for t in (w13, w2))
    scales = dict(w13_scale=w13_scale.to(device), w2_scale=w2_scale.to(device))
    out = fused_experts(x, *packed, weights, ids, config=config, **scales, **on)
    assert out.dtype == dtype and out.shape == case.x.shape
    torch.testing.assert_close(out, expected, **_TOL[dtype])


def test_mxfp4_hand_packed_weights(device: torch.device) -> None:
    """One expert, hidden = intermediate = 32, x = (1, 4, 0, ...): nibble order, signs, scales, by hand.

    gate row 0:  byte 0x92 (k0: code 2 = +1, k1: code 9 = -0.5) x 2^1   ->  2 - 4     = -2
    up row 0:    byte 0x7F (k0: 15 = -6, k1: 7 = +6) x 2^-2             -> -1.5 + 6   = 4.5
    gate/up 31:  byte 0x02 (k0: +1) x 2^0                               ->  1, 1
    w2 row 0:    byte 0 0x05 (k0: 5 = +3);  row 1: byte 15 0xC0 (k31: 12 = -2) x 2^-1
    """
    w13 = torch.zeros(1, 64, 16, dtype=torch.uint8)
    w13_scale = torch.full((1, 64, 1), 127, dtype=torch.uint8)
    w13[0, 0, 0], w13_scale[0, 0, 0] = 0x92, 128
    w13[0, 32, 0], w13_scale[0, 32, 0] = 0x7F, 125
    w13[0, 31, 0] = w13[0, 63, 0] = 0x02
    w2 = torch.zeros(1, 32, 16, dtype=torch.uint8)
    w2_scale = torch.full((1, 32, 1), 127, dtype=torch.uint8)
    w2[0, 0, 0] = 0x05
    w2[0, 1, 15], w2_scale[0, 1, 0] = 0xC0, 126
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1] = 1.0, 4.0
    silu = torch.nn.functional.silu
    expected = torch.zeros(1, 32)
    expected[0, 0] = 3.0 * silu(torch.tensor(-2.0)) * 4.5
    expected[0, 1] = -1.0 * silu(torch.tensor(1.0)) * 1.0
    weights, ids = torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int64)
    args = [t.to(device) for t in (x, w13, w2, weights, ids)]
    out = fused_experts(*args, w13_scale=w13_scale.to(device), w2_scale=w2_scale.to(device))
    torch.testing.assert_close(out.cpu(), expected, atol=1e-6, rtol=1e-6)


@pytest.fixture
def triton_backend() -> Iterator[None]:
    previous_backend, previous_mode = attention.backend_name(), fused_ops.fusion_mode()
    attention.use_backend("triton")
    yield
    attention.use_backend(previous_backend)
    fused_ops.set_fusion(previous_mode)


@pytest.mark.usefixtures("triton_backend")
def test_moe_layer_runs_the_fused_kernel_where_layers_fuse(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    moe = MoE(64, 32, num_experts=8, top_k=2, act="silu", renormalize=True, shared_intermediate_size=48).to(device)
    for p in moe.parameters():
        p.data.normal_(0, 0.2)
    x = torch.randn(9, 64, device=device)
    fused_ops.set_fusion("off")
    unfused = moe(x)
    calls: list[int] = []
    from pagedserve.kernels import fused_moe

    real = fused_moe.fused_experts

    def counted(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_moe, "fused_experts", counted)
    fused_ops.set_fusion("on")
    torch.testing.assert_close(moe(x), unfused, atol=1e-4, rtol=1e-4)
    assert calls == [1]
    weights, ids = route(moe.gate(x), 2, "softmax", True)
    torch.testing.assert_close(
        moe.experts(x, weights, ids), moe.experts.forward_dense(x, weights, ids), atol=1e-4, rtol=1e-4
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_a_cuda_graph_captures_the_whole_layer_from_its_first_call(num_tokens: int) -> None:
    """Decode steps run as CUDA graphs: no host sync or host copy may hide in the alignment, even when the
    capture is the first call of its shape (the one-token layout is not cached then)."""
    from pagedserve.kernels import moe_align

    moe_align._one_token_layout.cache_clear()
    case = random_case(num_tokens, 64, 32, 16, 4, seed=num_tokens)
    args = [t.cuda() for t in (case.x, case.w13, case.w2, case.topk_weights, case.topk_ids)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(*args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), per_token_oracle(case), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, fused_experts(*args), atol=0, rtol=0)
