"""Residual add + RMSNorm in one pass: `residual += x; x = rmsnorm(residual) * weight`, both in place.

Unfused this is three launches (add, norm, and the next layer reads the sum again); fused, each row of
`hidden_size` elements is read twice and written twice once. The sum is rounded to the storage dtype
before the norm, exactly as the unfused `x + residual` would be, so both paths normalise the same values.
One program per token row; hidden sizes up to 16k fit one register tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.launch_config import next_power_of_2
from pagedserve.kernels.pdl import prologue


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden] in: the sublayer output, out: the normed sum
    residual_ptr,  # [num_tokens, hidden] in: the residual stream, out: residual + x
    weight_ptr,  # [hidden]
    stride_x,
    stride_residual,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_residual + offs, s, mask=mask)
    else:  # first layer: the residual is x itself
        s = x
        tl.store(residual_ptr + row * stride_residual + offs, s, mask=mask)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * stride_x + offs, rms_norm_row(s, w, eps, HIDDEN, x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_row(s, w, eps, HIDDEN: tl.constexpr, dtype: tl.constexpr):
    """rmsnorm(s) * w for one row (`w` float32), in `dtype`: HF rounds the normed value to the input dtype before
    the weight multiply; so do we."""
    h = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    normed = (h * inv_rms).to(dtype).to(tl.float32)
    return (normed * w).to(dtype)


def add_rms_norm_(
    x: torch.Tensor,  # [num_tokens, hidden]: overwritten with the normed sum
    residual: torch.Tensor | None,  # [num_tokens, hidden]: overwritten with residual + x; None = x alone
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual_out: torch.Tensor | None = None,  # where to store the new residual when `residual` is None
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, new residual)
    """In place: returns (x, residual) holding (rmsnorm(residual + x) * weight, residual + x)."""
    num_tokens, hidden = x.shape
    assert x.stride(1) == 1 and weight.shape == (hidden,)
    has_residual = residual is not None
    if residual is None:
        residual = residual_out if residual_out is not None else torch.empty_like(x)
    assert residual.shape == x.shape and residual.stride(1) == 1
    if num_tokens == 0:
        return x, residual
    block = next_power_of_2(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x,
        residual,
        weight,
        x.stride(0),
        residual.stride(0),
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=has_residual,
        num_warps=min(16, max(1, block // 256)),
        **pdl.launch(x.device),
    )
    return x, residual
