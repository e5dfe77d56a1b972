"""Combine flash-decoding partial results: one program per (token, query head).

Each segment s left an unnormalised output o_s, its running max m_s (log2 domain) and its sum
l_s. With M = max_s m_s and w_s = 2^(m_s - M):   out = sum_s w_s * o_s / sum_s w_s * l_s.
A segment that saw no key stored m_s = -inf, l_s = 0, o_s = 0, so its weight is exactly 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.pdl import prologue


@triton.jit
def _reduce_segments_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    seg_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32
    seg_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    seg_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    seg_row = (token * NUM_HEADS + head) * NUM_SEGMENTS + offs_s  # [NUM_SEGMENTS] int64
    seg_max = tl.load(seg_max_ptr + seg_row)
    seg_sum = tl.load(seg_sum_ptr + seg_row)
    weight = tl.math.exp2(seg_max - tl.max(seg_max, 0))  # [NUM_SEGMENTS]
    seg_out = tl.load(seg_out_ptr + seg_row[:, None] * HEAD_DIM_PADDED + offs_d[None, :])
    out = tl.sum(seg_out * weight[:, None], 0) / tl.sum(seg_sum * weight, 0)  # [HEAD_DIM_PADDED]
    out_offs = token * stride_out_token + head * stride_out_head + offs_d
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def reduce_segments(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    seg_out: torch.Tensor,  # [num_tokens, num_heads, num_segments, head_dim_padded] fp32
    seg_max: torch.Tensor,  # [num_tokens, num_heads, num_segments] fp32
    seg_sum: torch.Tensor,  # [num_tokens, num_heads, num_segments] fp32
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = out.shape
    num_segments, head_dim_padded = seg_out.shape[2], seg_out.shape[3]
    assert out.stride(2) == 1 and seg_out.is_contiguous() and seg_max.is_contiguous()
    _reduce_segments_kernel[(num_tokens, num_heads)](
        out,
        seg_out,
        seg_max,
        seg_sum,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        NUM_SEGMENTS=num_segments,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        num_warps=1 if head_dim_padded <= 64 else 2,
        **pdl.launch(out.device),
    )
    return out
