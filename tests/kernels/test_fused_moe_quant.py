"""FP8 and int4 (W4A16) experts in the fused-MoE kernel (interpreted on CPU, compiled on CUDA): the kernel on
the quantized weights equals the same kernel on the weights they mean (expert_quant.dequantize), and both
equal the torch reference, which dequantises per expert as it runs. Per-tensor fp8 scales (broadcast over
rows), int4 groups smaller than, equal to and larger than the K tile, per-channel groups that no K tile
divides, asymmetric zero points; the layouts checked by hand."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels import expert_quant
from pagedserve.kernels.fused_moe import fused_experts
from pagedserve.kernels.launch_config import MoeConfig
from pagedserve.kernels.moe_reference import experts_dense, experts_grouped
from tests.kernels.moe_cases import per_token_oracle, random_case

_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}
_CASES = [
    # dtype, swiglu, num_tokens, top_k, config
    (torch.float32, False, 13, 2, MoeConfig(16, 64, 64, 1, 4, 2)),  # hidden/intermediate 96: K tails
    (torch.float32, True, 1, 4, MoeConfig(16, 32, 32, 1, 4, 2)),  # decode, gpt-oss's activation and biases
    (torch.float16, False, 9, 2, None),  # the config choose_moe_config gives
]
_IDS = ["fp32-silu-ragged", "fp32-swiglu-decode", "fp16-silu-auto"]


def _on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize(("dtype", "swiglu", "num_tokens", "top_k", "config"), _CASES, ids=_IDS)
def test_fp8_experts_equal_their_dequantised_weights(
    dtype: torch.dtype,
    swiglu: bool,
    num_tokens: int,
    top_k: int,
    config: MoeConfig | None,
    per_tensor: bool,
    device: torch.device,
) -> None:
    case = random_case(num_tokens, 96, 96, 8, top_k, swiglu=swiglu, dtype=dtype, seed=num_tokens)
    (w13, s13), (w2, s2) = expert_quant.quantize_fp8(case.w13), expert_quant.quantize_fp8(case.w2)
    if per_tensor:  # one scale per expert and weight (gate and up each its own), repeated over the rows
        w13, s13 = _per_tensor(case.w13, halves=2)
        w2, s2 = _per_tensor(case.w2, halves=1)
    _check_against_dense(case, (w13, s13, None), (w2, s2, None), config, device)


def _per_tensor(w: torch.Tensor, halves: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [expert_quant.quantize_fp8(p.flatten(1)[:, None, :]) for p in w.chunk(halves, dim=1)]
    codes = torch.cat([q.view(p.shape) for (q, _), p in zip(parts, w.chunk(halves, dim=1), strict=True)], dim=1)
    rows = w.shape[1] // halves
    return codes, torch.cat([s.expand(-1, rows) for _, s in parts], dim=1).contiguous()


@pytest.mark.parametrize(("group_size", "size"), [(32, 96), (64, 128), (96, 96)], ids=["g32", "g64", "g96-per-channel"])
@pytest.mark.parametrize(("dtype", "swiglu", "num_tokens", "top_k", "config"), _CASES, ids=_IDS)
def test_int4_experts_equal_their_dequantised_weights(
    dtype: torch.dtype,
    swiglu: bool,
    num_tokens: int,
    top_k: int,
    config: MoeConfig | None,
    group_size: int,
    size: int,
    device: torch.device,
) -> None:
    """K tiles of 64 hold two groups of 32 (K 96: a half tile at the end), one of 64, and fall back to 32 for
    groups of 96; tiles of 32 lie inside one group of 64."""
    case = random_case(num_tokens, size, size, 8, top_k, swiglu=swiglu, dtype=dtype, seed=num_tokens)
    w13_q = expert_quant.quantize_int4(case.w13, group_size)
    w2_q = expert_quant.quantize_int4(case.w2, group_size)
    assert w13_q[0].dtype == torch.uint8 and w13_q[0].shape == (8, 2 * size, size // 2)
    assert w13_q[1].shape == w13_q[2].shape == (8, 2 * size, size // group_size)
    _check_against_dense(case, w13_q, w2_q, config, device)


def _check_against_dense(
    case: object,
    w13_q: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    w2_q: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    config: MoeConfig | None,
    device: torch.device,
) -> None:
    """The kernel on the quantized weights vs the kernel on the dense weights they mean vs the torch paths
    on the quantized weights (dequantising as they run) vs the per-token oracle on the dense ones."""
    x, weights, ids = _on(device, case.x, case.topk_weights, case.topk_ids)  # type: ignore[attr-defined]
    dtype = x.dtype
    on = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}  # type: ignore[attr-defined]
    dense = [expert_quant.dequantize(*q, dtype=dtype).to(device) for q in (w13_q, w2_q)]
    quant = dict(
        w13_scale=w13_q[1].to(device),
        w2_scale=w2_q[1].to(device),
        w13_zeros=None if w13_q[2] is None else w13_q[2].to(device),
        w2_zeros=None if w2_q[2] is None else w2_q[2].to(device),
    )
    w13, w2 = _on(device, w13_q[0], w2_q[0])
    expected = fused_experts(x, *dense, weights, ids, config=config, **on)
    out = fused_experts(x, w13, w2, weights, ids, config=config, **quant, **on)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected, **_TOL[dtype])
    case.w13, case.w2 = (d.cpu() for d in dense)  # type: ignore[attr-defined]
    oracle = per_token_oracle(case)
    torch.testing.assert_close(out.float().cpu(), oracle, **_TOL[dtype])
    for path in (experts_grouped, experts_dense):
        got = path(x, w13, w2, weights, ids, **quant, **on)
        torch.testing.assert_close(got.float().cpu(), oracle, **_TOL[dtype])


def test_int4_layout_by_hand(device: torch.device) -> None:
    """One expert, hidden = intermediate = 32, group 16, x = (1, 2, 0, ..., 0, 1 at k=16).

    gate row 0: byte 0 = 0x3A: k0 code 10, k1 code 3; zero 8, scale 0.5 -> k0 +1, k1 -2.5; x . = 1 - 5 = -4
                group 1 (k16..31): byte 8 = 0x0C: k16 code 12, zero 4, scale 0.25 -> +2; total -2
    up row 0:   byte 0 = 0x99 (k0, k1 code 9), zero 7, scale 1 -> 2 + 4 = 6; group 1 all zero codes, zero 0
    w2 row 5:   byte 0 = 0x0F (k0 code 15), zero 0, scale 0.125 -> 1.875 x hidden unit 0
    """
    w13 = torch.zeros(1, 64, 16, dtype=torch.uint8)
    s13 = torch.ones(1, 64, 2)
    z13 = torch.zeros(1, 64, 2, dtype=torch.uint8)
    w13[0, 0, 0], z13[0, 0, 0], s13[0, 0, 0] = 0x3A, 8, 0.5
    w13[0, 0, 8], z13[0, 0, 1], s13[0, 0, 1] = 0x0C, 4, 0.25
    w13[0, 32, 0], z13[0, 32, 0] = 0x99, 7
    w2 = torch.zeros(1, 32, 16, dtype=torch.uint8)
    s2 = torch.ones(1, 32, 2)
    z2 = torch.zeros(1, 32, 2, dtype=torch.uint8)
    w2[0, 5, 0], s2[0, 5, 0] = 0x0F, 0.125
    dense13 = expert_quant.dequantize(w13, s13, z13, torch.float32)
    assert (
        dense13[0, 0, :2].tolist() == [1.0, -2.5]
        and dense13[0, 0, 16] == 2.0
        and dense13[0, 32, :2].tolist() == [2.0, 2.0]
    )
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 16] = 1.0, 2.0, 1.0
    silu = torch.nn.functional.silu
    expected = torch.zeros(1, 32)
    expected[0, 5] = 1.875 * silu(torch.tensor(-2.0)) * 6.0
    weights, ids = torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int64)
    args = _on(device, x, w13, w2, weights, ids)
    quant = dict(zip(("w13_scale", "w2_scale", "w13_zeros", "w2_zeros"), _on(device, s13, s2, z13, z2), strict=True))
    out = fused_experts(*args, config=MoeConfig(16, 32, 32, 1, 4, 2), **quant)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-6, rtol=1e-6)


def test_fp8_scale_multiplies_output_channels(device: torch.device) -> None:
    """w = 1.0 everywhere; gate rows scaled 2, up rows 3 (row 0 of up 0.5), w2 rows 0.25: each output channel
    takes its own scale."""
    w13 = torch.ones(1, 64, 32).to(expert_quant.FP8_DTYPE)
    s13 = torch.cat([torch.full((32,), 2.0), torch.full((32,), 3.0)])[None].clone()
    s13[0, 32] = 0.5
    w2 = torch.ones(1, 32, 32).to(expert_quant.FP8_DTYPE)
    s2 = torch.full((1, 32), 0.25)
    x = torch.full((1, 32), 1.0 / 32)
    silu = torch.nn.functional.silu
    hidden = silu(torch.tensor(2.0)) * torch.full((32,), 3.0)
    hidden[0] = silu(torch.tensor(2.0)) * 0.5
    expected = torch.full((1, 32), 0.25 * float(hidden.sum()))
    weights, ids = torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int64)
    out = fused_experts(*_on(device, x, w13, w2, weights, ids), w13_scale=s13.to(device), w2_scale=s2.to(device))
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 and CUDA graphs need a GPU")
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_bf16_experts_on_cuda_in_a_graph(fmt: str, num_tokens: int) -> None:
    """bf16 activations (what serving runs) on the Qwen3-MoE-like shape scaled down, group 128; captured as a
    CUDA graph from the first call, as decode steps run."""
    case = random_case(num_tokens, 256, 128, 16, 4, dtype=torch.bfloat16, seed=num_tokens)
    if fmt == "fp8":
        (w13, s13), (w2, s2) = expert_quant.quantize_fp8(case.w13), expert_quant.quantize_fp8(case.w2)
        quant = dict(w13_scale=s13.cuda(), w2_scale=s2.cuda())
    else:
        (w13, s13, z13), (w2, s2, z2) = (expert_quant.quantize_int4(w, 128) for w in (case.w13, case.w2))
        quant = dict(w13_scale=s13.cuda(), w2_scale=s2.cuda(), w13_zeros=z13.cuda(), w2_zeros=z2.cuda())
    x, weights, ids, w13, w2 = _on(torch.device("cuda"), case.x, case.topk_weights, case.topk_ids, w13, w2)
    dense = [
        expert_quant.dequantize(w, quant[f"{n}_scale"], quant.get(f"{n}_zeros"), x.dtype)
        for n, w in (("w13", w13), ("w2", w2))
    ]
    expected = fused_experts(x, *dense, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids, **quant)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
