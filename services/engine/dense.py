"""Dense linears: the decode GEMV (kernels/gemv.py) for a few rows on CUDA, cuBLAS for everything else.

At batch 1 a linear is a matrix-vector product, where cuBLAS's 8-row tensor-core tiles leave bandwidth
unused; the GEMV reads the weight at up to ~4.3 TB/s on an H200 (bench/results/gemv_h200x2_2026-11-28/).
`layers.DenseLinear` and the tensor-parallel linears call `linear`. Outside the models package so that
parallel/linear.py can import it without loading every model family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.services.engine import attention

MAX_ROWS = 4  # kernels/gemv.MAX_ROWS (this module imports no kernels: Triton is optional)
_max_rows = 1  # RunnerConfig.gemv_max_rows (its default here too: models driven without a worker); 0: cuBLAS
_plain_forwards: set[Callable[..., Any]] = set()  # forwards that are exactly linear(x, self.weight, self.bias)
L = TypeVar("L", bound=type[nn.Module])


def set_gemv_max_rows(rows: int, device: torch.device | None = None) -> None:
    """Linears of up to `rows` rows take the GEMV on CUDA; 0: none does. On a CUDA `device` the GEMV's
    split-K counters are allocated now, before any CUDA graph is captured."""
    global _max_rows
    if not 0 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv_max_rows: {rows} is not in 0-{MAX_ROWS}")
    _max_rows = rows
    if rows and device is not None and device.type == "cuda":
        from pagedserve.kernels.w4a16_gemv import reserve_split_counters

        reserve_split_counters(torch.device("cuda", torch.cuda.current_device()) if device.index is None else device)


def gemv_max_rows() -> int:
    return _max_rows


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear` runs the GEMV: CUDA half-precision rows, few enough, with the Triton backend active,
    operands of one dtype, contiguous rows and bias (anything else goes to F.linear, which checks it)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= _max_rows
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.shape[1] == weight.shape[1]
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and attention.backend_name() == "triton"
    )


def linear(
    x: torch.Tensor,  # [n, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [n, N] to write into (no bias then on the cuBLAS path)
) -> torch.Tensor:
    """F.linear, with the decode GEMV where it applies (`takes_gemv`)."""
    if takes_gemv(x, weight, bias):
        from pagedserve.kernels.gemv import gemv

        return gemv(x, weight, bias, out=out)
    if out is None:
        return F.linear(x, weight, bias)
    assert bias is None, "linear(out=...) takes no bias on the cuBLAS path"
    return torch.mm(x, weight.t(), out=out)


def plain_linear(cls: L) -> L:
    """Class decorator: `cls.forward(x)` is `linear(x, self.weight, self.bias)`, so `gate_up_silu` may stand in
    for it (a subclass that overrides forward, as LoRA and quantized layers do, is not plain)."""
    _plain_forwards.add(cls.forward)
    return cls


def gate_up_silu(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of a fused [gate; up] projection of one row in one GEMV launch (kernels/gemv.py
    `gemv_silu_mul`: the same bits as the projection, then the SiLU kernel), where `linear` would take the
    GEMV; None elsewhere (the caller projects, then applies the activation)."""
    if type(layer).forward not in _plain_forwards or x.dim() != 2 or x.shape[0] != 1:
        return None
    weight, bias = layer.weight, layer.bias
    if bias is not None or not isinstance(weight, torch.Tensor) or weight.shape[0] % 2 or not takes_gemv(x, weight):
        return None
    from pagedserve.kernels.gemv import gemv_silu_mul

    return gemv_silu_mul(x, weight)
