"""Fused mixture-of-experts: two grouped GEMMs over every expert at once (the technique of vLLM's fused_moe).

    topk_ids ──moe_align (kernels/moe_align*.py)──► sorted_token_ids, expert_ids (one expert per BLOCK_M block)
    x [T, H] ──GEMM 1: w13 gate and up tiles, bias, activation──► hidden [T * top_k, I]   (row = assignment)
    hidden   ──GEMM 2: w2, bias, x topk weight──────────────────► down   [T * top_k, H]
    down.view(T, top_k, H).sum(1) ──► out [T, H]

Each program takes one BLOCK_M block of sorted assignment rows (all of one expert) and one BLOCK_N tile
of outputs, and streams only that expert's weight tiles: experts nobody chose are never read, and a
weight tile is read once per block, not once per token. GEMM 1 computes the gate and the up tile side by
side, so the activation runs on its fp32 accumulators and the [T * top_k, 2I] gate_up never exists.

No host sync: the grid is sized from host integers (the padded row bound), programs past
`num_tokens_post_padded` return at once, so a CUDA graph captures a decode step. Layouts and the
activations are kernels/moe_reference.py's, the oracle.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from pagedserve.kernels.launch_config import MoeConfig, choose_moe_config
from pagedserve.kernels.moe_align import moe_align_block_size
from pagedserve.kernels.moe_align_triton import moe_align_block_size_triton
from pagedserve.kernels.moe_reference import check_activation

# The GEMM's ACTIVATION constexpr: none (GEMM 2), or a gated one on GEMM 1's [gate | up] pair.
_ACTIVATION_CODES = {"none": 0, "silu": 1, "swigluoai": 2}


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [num_a_rows, K]: x (row = assignment // A_ROW_DIV) or GEMM 1's output (row = assignment)
    b_ptr,  # [num_experts, (2 if GATED) * N, K]: w13 or w2, K contiguous
    bias_ptr,  # [num_experts, (2 if GATED) * N] (HAS_BIAS)
    c_ptr,  # [num_assignments, N], row = assignment
    topk_weights_ptr,  # [num_assignments] float32 (MUL_ROUTED_WEIGHT)
    sorted_token_ids_ptr,  # [num_padded_rows] int64: assignments, padding = num_assignments
    expert_ids_ptr,  # [num_padded_rows // BLOCK_M] int64
    num_tokens_post_padded_ptr,  # [1] int64: rows in use
    N,
    K,
    num_padded_rows,
    num_assignments,
    stride_am,
    stride_be,
    stride_bn,
    stride_bias_e,
    stride_cm,
    swiglu_alpha,
    swiglu_limit,
    A_ROW_DIV: tl.constexpr,  # top_k for GEMM 1 (x has one row per token), 1 for GEMM 2
    ACTIVATION: tl.constexpr,  # _ACTIVATION_CODES; > 0 means GATED (up tile at row offset N)
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no tf32 rounding), else unused
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # GROUP_M blocks of rows walk the N tiles together, so their activation rows stay in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_padded_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return

    assignment = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M] int64
    row_mask = assignment < num_assignments
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    # Columns wrap modulo N so weight loads need no mask; the store masks the wrapped ones.
    offs_n = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (assignment // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    up_offset = N * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if ACTIVATION > 0:
            b_up = tl.load(b_ptrs + up_offset, mask=k_mask[:, None], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_e
        acc += tl.load(bias_row + offs_n).to(tl.float32)[None, :]
        if ACTIVATION > 0:
            acc_up += tl.load(bias_row + N + offs_n).to(tl.float32)[None, :]
    if ACTIVATION == 1:  # silu(gate) * up
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif ACTIVATION == 2:  # gpt-oss's clamped swiglu
        gate = tl.minimum(acc, swiglu_limit)
        up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
        acc = (up + 1.0) * gate / (1.0 + tl.exp(-gate * swiglu_alpha))
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + assignment, mask=row_mask, other=0.0)[:, None]

    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + assignment[:, None] * stride_cm + offs_cn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_cn < N)[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_row_div: int,
    activation: str,
    config: MoeConfig,
    swiglu: tuple[float, float],
) -> None:
    sorted_token_ids, expert_ids, num_tokens_post_padded = aligned
    n, k = c.shape[1], a.shape[1]
    assert a.stride(1) == 1 and b.stride(2) == 1 and c.stride(1) == 1, "K and output columns must be contiguous"
    assert bias is None or bias.stride(1) == 1
    num_padded_rows = sorted_token_ids.shape[0]
    grid = (triton.cdiv(num_padded_rows, config.block_m) * triton.cdiv(n, config.block_n),)
    _grouped_gemm_kernel[grid](
        a,
        b,
        bias if bias is not None else b,
        c,
        topk_weights if topk_weights is not None else c,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        n,
        k,
        num_padded_rows,
        c.shape[0],
        a.stride(0),
        b.stride(0),
        b.stride(1),
        bias.stride(0) if bias is not None else 0,
        c.stride(0),
        swiglu[0],
        swiglu[1],
        A_ROW_DIV=a_row_div,
        ACTIVATION=_ACTIVATION_CODES[activation],
        HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


# The one-program Triton alignment beats torch's ~20 launches up to about this many (token, slot) pairs;
# past it the torch sort's parallelism wins. H100, 128 experts: 2,048 pairs 21.8 vs 85.3 µs, 32,768 pairs
# 238 vs 126 µs (bench/results/moe_kernel_h100/).
TRITON_ALIGN_MAX_ASSIGNMENTS = 8192

# Config choice depends on host integers only, so it is cached per layer shape and batch size.
_config = cache(choose_moe_config)


def fused_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]  rows [ gate | up ]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    config: MoeConfig | None = None,  # override the chosen tiles (benchmarks, tests)
) -> torch.Tensor:  # [num_tokens, hidden]
    check_activation(activation, swiglu_alpha, swiglu_limit)
    num_tokens, hidden = x.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, intermediate), (w13.shape, w2.shape)
    if num_tokens == 0:
        return torch.empty_like(x)
    if config is None:
        dtype = str(x.dtype).removeprefix("torch.")
        config = _config(
            num_experts=num_experts,
            top_k=top_k,
            hidden=hidden,
            intermediate=intermediate,
            num_tokens=num_tokens,
            dtype=dtype,
        )
    align = moe_align_block_size_triton
    if num_tokens == 1 or num_tokens * top_k > TRITON_ALIGN_MAX_ASSIGNMENTS:
        align = moe_align_block_size  # one token: a constant layout, no launch; prefills: the torch sort
    aligned = align(topk_ids, config.block_m, num_experts)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    swiglu = (float(swiglu_alpha or 0.0), float(swiglu_limit or 0.0))
    x = x.contiguous()
    hidden_rows = x.new_empty((num_tokens * top_k, intermediate))
    _grouped_gemm(x, w13, w13_bias, hidden_rows, None, aligned, top_k, activation, config, swiglu)
    down = x.new_empty((num_tokens * top_k, hidden))
    _grouped_gemm(hidden_rows, w2, w2_bias, down, weights, aligned, 1, "none", config, swiglu)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
