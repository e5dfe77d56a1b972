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

MXFP4 weights (gpt-oss as OpenAI ships it; services/engine/models/mxfp4.py) stay 4-bit in memory: pass
`w13`/`w2` as uint8 codes, two a byte along K (the low nibble first), with `w13_scale`/`w2_scale`, one
E8M0 byte per 32 values along K:

    w13 [E, 2I, hidden / 2] + w13_scale [E, 2I, hidden / 32]      w2 [E, hidden, I / 2] + w2_scale [E, hidden, I / 32]

Each program then loads a [BLOCK_N, BLOCK_K / 2] byte tile, dequantises it in registers to the
activations' dtype and feeds the same tl.dot: a decode step reads ~4.25 bits a weight instead of 16.

FP8 and int4 (W4A16: AWQ/GPTQ/compressed-tensors repacked at load) experts stay quantized the same way, in
kernels/expert_quant.py's layouts; activations stay 16-bit (weight-only quantization):

    fp8   w13 [E, 2I, hidden] float8_e4m3fn + w13_scale [E, 2I] fp32: the tile is cast to the activations'
          dtype (exact), and the per-output-channel scale multiplies the fp32 accumulator once after the K loop
    int4  w13 [E, 2I, hidden / 2] uint8 (low nibble first) + w13_scale [E, 2I, hidden / G] + w13_zeros (same,
          uint8): (q - zero) * scale per tile in registers, like MXFP4's
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl

from pagedserve.kernels.expert_quant import int4_group_size, weight_format
from pagedserve.kernels.launch_config import MoeConfig, choose_moe_config
from pagedserve.kernels.moe_align import moe_align_block_size
from pagedserve.kernels.moe_align_triton import moe_align_block_size_triton
from pagedserve.kernels.moe_reference import check_activation

# The GEMM's ACTIVATION constexpr: none (GEMM 2), or a gated one on GEMM 1's [gate | up] pair.
_ACTIVATION_CODES = {"none": 0, "silu": 1, "swigluoai": 2}
MXFP4_GROUP = 32  # values along K sharing one E8M0 scale (mxfp4.BLOCK; BLOCK_K must be a multiple)
# The GEMM's QUANT constexpr: how b is stored (kernels/expert_quant.py)
_QUANT_CODES = {"dense": 0, "mxfp4": 1, "fp8": 2, "int4": 3}


@triton.jit
def _mxfp4_tile(packed_ptrs, scale_ptrs, k_left, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """[BLOCK_K, BLOCK_N] weights in `dtype` from a [BLOCK_N, BLOCK_K / 2] tile of bytes (two FP4 E2M1
    codes each, the low nibble first along K) and its [BLOCK_N, BLOCK_K / 32] E8M0 scales; columns at or
    past `k_left` read as 0."""
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 32)
    packed = tl.load(packed_ptrs, mask=(offs_kb < k_left // 2)[None, :], other=0).to(tl.int32)
    scale = tl.load(scale_ptrs, mask=(offs_ks < k_left // 32)[None, :], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))  # k = 2j: low, 2j + 1: high
    # E2M1 magnitude m = 2 exponent bits e, 1 mantissa bit f: f / 2 if e == 0, else (1 + f / 2) 2^(e - 1).
    # Times 4 that is an integer: 2f, or (2 + f) << e; the 1/4 goes into the scale (all exact in fp32).
    e = (codes >> 1) & 3
    f = codes & 1
    quadruple = tl.where(e == 0, 2 * f, (2 + f) << e)
    quadruple = tl.where((codes & 8) != 0, -quadruple, quadruple)
    # 2^(s - 127) as fp32 bits: the biased exponent s in place (s = 0, i.e. 2^-127, reads as 0: never in weights)
    group_scale = (scale << 23).to(tl.float32, bitcast=True) * 0.25
    values = tl.reshape(quadruple.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32)) * group_scale[:, :, None]
    return tl.trans(tl.reshape(values, (BLOCK_N, BLOCK_K)).to(dtype))


@triton.jit
def _int4_tile(
    packed_ptrs,
    scale_ptrs,
    zero_ptrs,
    k_left,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    dtype: tl.constexpr,
):
    """[BLOCK_K, BLOCK_N] weights in `dtype` from a [BLOCK_N, BLOCK_K / 2] tile of bytes (two 4-bit codes
    each, the low nibble first along K) and the [BLOCK_N, BLOCK_K / SUB_K] scales and zero points of its
    runs of SUB_K values (SUB_K = min(group size, BLOCK_K)); columns at or past `k_left` read as 0."""
    offs_kb = tl.arange(0, BLOCK_K // 2)
    sub_mask = (tl.arange(0, BLOCK_K // SUB_K) * SUB_K < k_left)[None, :]
    packed = tl.load(packed_ptrs, mask=(offs_kb < k_left // 2)[None, :], other=0).to(tl.int32)
    scale = tl.load(scale_ptrs, mask=sub_mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptrs, mask=sub_mask, other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K // SUB_K, SUB_K))
    values = (codes - zero[:, :, None]).to(tl.float32) * scale[:, :, None]
    return tl.trans(tl.reshape(values, (BLOCK_N, BLOCK_K)).to(dtype))


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [num_a_rows, K]: x (row = assignment // A_ROW_DIV) or GEMM 1's output (row = assignment)
    b_ptr,  # [num_experts, (2 if GATED) * N, K]: w13 or w2, K contiguous (MXFP4, int4: uint8, K / 2 bytes)
    b_scale_ptr,  # [num_experts, (2 if GATED) * N, K / 32] uint8 (MXFP4), [.., K / G] (int4), [E, 2N] fp32 (fp8)
    b_zero_ptr,  # int4: like b_scale, uint8
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
    stride_scale_e,
    stride_scale_n,
    group_size,  # int4: values along K sharing a scale and zero point
    swiglu_alpha,
    swiglu_limit,
    A_ROW_DIV: tl.constexpr,  # top_k for GEMM 1 (x has one row per token), 1 for GEMM 2
    ACTIVATION: tl.constexpr,  # _ACTIVATION_CODES; > 0 means GATED (up tile at row offset N)
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    QUANT: tl.constexpr,  # _QUANT_CODES: dense, MXFP4 / int4 (dequantised per tile), fp8 (scaled per column)
    SUB_K: tl.constexpr,  # int4: min(group size, BLOCK_K), the values of a tile sharing one scale
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if QUANT == 1:
        # [BLOCK_N, BLOCK_K / 2] bytes and [BLOCK_N, BLOCK_K / 32] scales: rows as stored, K contiguous
        b_ptrs = b_ptr + expert * stride_be + offs_n[:, None] * stride_bn + tl.arange(0, BLOCK_K // 2)[None, :]
        s_ptrs = b_scale_ptr + expert * stride_scale_e + offs_n[:, None] * stride_scale_n
        s_ptrs += tl.arange(0, BLOCK_K // 32)[None, :]
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            b = _mxfp4_tile(b_ptrs, s_ptrs, K - k0, BLOCK_N, BLOCK_K, a.dtype)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if ACTIVATION > 0:
                b_up = _mxfp4_tile(
                    b_ptrs + N * stride_bn, s_ptrs + N * stride_scale_n, K - k0, BLOCK_N, BLOCK_K, a.dtype
                )
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 32
    elif QUANT == 3:
        b_ptrs = b_ptr + expert * stride_be + offs_n[:, None] * stride_bn + tl.arange(0, BLOCK_K // 2)[None, :]
        # scales and zero points share one layout: [rows, K / G] per expert
        sz_rows = expert * stride_scale_e + offs_n[:, None] * stride_scale_n
        offs_sub = tl.arange(0, BLOCK_K // SUB_K) * SUB_K
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=row_mask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            sz_offs = sz_rows + ((k0 + offs_sub) // group_size)[None, :]  # the group of each run of SUB_K
            s_ptrs, z_ptrs = b_scale_ptr + sz_offs, b_zero_ptr + sz_offs
            b = _int4_tile(b_ptrs, s_ptrs, z_ptrs, K - k0, BLOCK_N, BLOCK_K, SUB_K, a.dtype)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if ACTIVATION > 0:
                up = N * stride_bn
                sz_up = N * stride_scale_n
                b_up = _int4_tile(b_ptrs + up, s_ptrs + sz_up, z_ptrs + sz_up, K - k0, BLOCK_N, BLOCK_K, SUB_K, a.dtype)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K // 2
    else:
        b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        up_offset = N * stride_bn
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0).to(a.dtype)  # fp8: exact in 16 bits
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if ACTIVATION > 0:
                b_up = tl.load(b_ptrs + up_offset, mask=k_mask[:, None], other=0.0).to(a.dtype)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if QUANT == 2:  # one scale per output channel: once per tile, not per K step
            scale_row = b_scale_ptr + expert * stride_scale_e
            acc = acc * tl.load(scale_row + offs_n)[None, :]
            if ACTIVATION > 0:
                acc_up = acc_up * tl.load(scale_row + N + offs_n)[None, :]

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
    quant: tuple[str, torch.Tensor | None, torch.Tensor | None],  # (format, scale, zeros): expert_quant's layouts
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
    fmt, b_scale, b_zeros = quant
    n, k = c.shape[1], a.shape[1]
    assert a.stride(1) == 1 and b.stride(2) == 1 and c.stride(1) == 1, "K and output columns must be contiguous"
    assert bias is None or bias.stride(1) == 1
    assert b_scale is None or b_scale.stride(-1) == 1
    block_k, group_size = config.block_k, 0
    if fmt == "mxfp4":
        assert block_k % MXFP4_GROUP == 0, config
    if fmt == "int4":
        assert b_scale is not None and b_zeros is not None and b_zeros.stride() == b_scale.stride()
        group_size = int4_group_size(b, b_scale)
        block_k = _int4_block_k(block_k, group_size)
    num_padded_rows = sorted_token_ids.shape[0]
    grid = (triton.cdiv(num_padded_rows, config.block_m) * triton.cdiv(n, config.block_n),)
    _grouped_gemm_kernel[grid](
        a,
        b,
        b_scale if b_scale is not None else b,
        b_zeros if b_zeros is not None else b,
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
        b_scale.stride(0) if b_scale is not None else 0,
        b_scale.stride(1) if b_scale is not None else 0,
        group_size,
        swiglu[0],
        swiglu[1],
        A_ROW_DIV=a_row_div,
        ACTIVATION=_ACTIVATION_CODES[activation],
        HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        QUANT=_QUANT_CODES[fmt],
        SUB_K=min(group_size, block_k) if group_size else 1,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _int4_block_k(block_k: int, group_size: int) -> int:
    """A K tile that holds whole groups or lies inside one (per-channel groups of e.g. 96: gcd 32)."""
    if block_k % group_size and group_size % block_k:
        block_k = math.gcd(block_k, group_size)
    assert block_k >= 16, f"int4 experts: group size {group_size} leaves a K tile of {block_k} (tl.dot needs 16)"
    return block_k


# The one-program Triton alignment beats torch's ~20 launches up to about this many (token, slot) pairs;
# past it the torch sort's parallelism wins. H100, 128 experts: 2,048 pairs 21.8 vs 85.3 µs, 32,768 pairs
# 238 vs 126 µs (bench/results/moe_kernel_h100/).
TRITON_ALIGN_MAX_ASSIGNMENTS = 8192

# Config choice depends on host integers only, so it is cached per layer shape and batch size.
_config = cache(choose_moe_config)


def fused_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]  rows [ gate | up ]  (quantized: see the docstring)
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    w13_scale: torch.Tensor | None = None,  # MXFP4, fp8, int4: kernels/expert_quant.py's layouts
    w2_scale: torch.Tensor | None = None,
    w13_zeros: torch.Tensor | None = None,  # int4 only
    w2_zeros: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    config: MoeConfig | None = None,  # override the chosen tiles (benchmarks, tests)
) -> torch.Tensor:  # [num_tokens, hidden]
    check_activation(activation, swiglu_alpha, swiglu_limit)
    num_tokens, hidden = x.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    fmt = _check_weights(x, w13, w2, (w13_scale, w2_scale), (w13_zeros, w2_zeros))
    if num_tokens == 0:
        return torch.empty_like(x)
    if config is None:
        dtype = str(x.dtype).removeprefix("torch.") + ("" if fmt == "dense" else f"+{fmt}")  # its own tuning key
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
    quant13, quant2 = (fmt, w13_scale, w13_zeros), (fmt, w2_scale, w2_zeros)
    _grouped_gemm(x, w13, quant13, w13_bias, hidden_rows, None, aligned, top_k, activation, config, swiglu)
    down = x.new_empty((num_tokens * top_k, hidden))
    _grouped_gemm(hidden_rows, w2, quant2, w2_bias, down, weights, aligned, 1, "none", config, swiglu)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)


def _check_weights(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scales: tuple[torch.Tensor | None, torch.Tensor | None],
    zeros: tuple[torch.Tensor | None, torch.Tensor | None],
) -> str:
    """The expert weights' shapes against x's hidden size; their format (expert_quant.FORMATS)."""
    hidden, (num_experts, rows, _) = x.shape[1], w13.shape
    intermediate = rows // 2
    fmt = weight_format(w13, scales[0], zeros[0])
    assert weight_format(w2, scales[1], zeros[1]) == fmt, "w13 and w2 must be in one format"
    full = ((num_experts, rows, hidden), (num_experts, hidden, intermediate))  # [E, rows, K] of w13, w2
    if fmt == "dense":
        assert (w13.shape, w2.shape) == full, (w13.shape, w2.shape)
        return fmt
    for w, scale, zero, (e, n, k) in zip((w13, w2), scales, zeros, full, strict=True):
        assert scale is not None
        if fmt == "fp8":
            assert w.shape == (e, n, k) and scale.shape == (e, n), (w.shape, scale.shape)
            assert scale.dtype == torch.float32, scale.dtype
            continue
        assert w.dtype == torch.uint8 and w.shape == (e, n, k // 2), (fmt, w.dtype, w.shape, k)
        if fmt == "mxfp4":
            assert k % MXFP4_GROUP == 0 and scale.dtype == torch.uint8, (k, scale.dtype)
            assert scale.shape == (e, n, k // MXFP4_GROUP), scale.shape
        else:  # int4
            assert zero is not None and zero.dtype == torch.uint8 and zero.shape == scale.shape, (zero, scale.shape)
            assert scale.shape[:2] == (e, n) and k % scale.shape[2] == 0, (scale.shape, k)
    return fmt
