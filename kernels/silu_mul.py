"""SiLU(gate) * up on the fused gate_up projection output, in one launch instead of three.

    gate_up  [num_tokens, 2 * intermediate]  = [ gate | up ]  ->  out [num_tokens, intermediate]

Math in fp32, rounded once. Grid: (token, column tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.pdl import prologue

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [num_tokens, 2 * INTERMEDIATE]
    out_ptr,  # [num_tokens, INTERMEDIATE]
    stride_in,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + INTERMEDIATE + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate]
    out: torch.Tensor | None = None,  # [num_tokens, intermediate]
) -> torch.Tensor:
    num_tokens, width = gate_up.shape
    intermediate = width // 2
    assert width == 2 * intermediate and gate_up.stride(1) == 1
    if out is None:
        out = gate_up.new_empty((num_tokens, intermediate))
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(intermediate))
    _silu_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        num_warps=4,
        **pdl.launch(gate_up.device),
    )
    return out
