"""Per-token dynamic FP8 (e4m3) quantisation of activations in one launch (torch needs ~6 per linear).

    scale[t] = max(amax(|x[t, :]|) / 448, MIN_SCALE);   x_q[t, :] = x[t, :] / scale[t]  (saturated)

One program per row: a first pass over the row finds the amax, a second writes the quantised row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [num_rows, K]
    out_ptr,  # [num_rows, K] float8_e4m3fn
    scale_ptr,  # [num_rows] float32
    stride_x,
    stride_out,
    K,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    inv_scale = 1.0 / scale
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x * inv_scale, -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * stride_out + offs, q.to(out_ptr.dtype.element_ty), mask=offs < K)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] fp8, [M] fp32)
    num_rows, k = x.shape
    assert x.stride(1) == 1
    out = torch.empty((num_rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return out, scale
    block = min(2048, triton.next_power_of_2(k))
    _quantize_rows_kernel[(num_rows,)](
        x,
        out,
        scale,
        x.stride(0),
        out.stride(0),
        k,
        FP8_MAX=FP8_MAX,
        MIN_SCALE=MIN_SCALE,
        BLOCK=block,
        num_warps=4 if block >= 1024 else 2,
    )
    return out, scale
