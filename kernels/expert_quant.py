"""Quantized expert weights as the fused-MoE kernel reads them, and their dequantization in torch.

One layout per format, every expert's rows as stored (output features), K (the inputs) contiguous:

    fp8    w [E, rows, K]      float8_e4m3fn    scale [E, rows] float32 (per output channel; a per-tensor
                                                 scale is repeated over its rows)
           W[e, r, k] = w[e, r, k] * scale[e, r]
    int4   w [E, rows, K / 2]  uint8, two 4-bit codes a byte along K, the low nibble first (as MXFP4's)
           scale [E, rows, K / G] in the activations' dtype, zeros [E, rows, K / G] uint8 (0..15)
           W[e, r, k] = (q[e, r, k] - zeros[e, r, k // G]) * scale[e, r, k // G]
    mxfp4  w [E, rows, K / 2]  uint8 FP4 codes, scale [E, rows, K / 32] uint8 E8M0 (services/.../mxfp4.py)

AWQ, GPTQ and compressed-tensors experts are repacked into the int4 layout at load
(services/engine/models/int4.py `repack_experts`): one layout for the kernel whatever the checkpoint's
packing. The torch functions here are the reference's and the CPU path's (kernels/moe_reference.py).
"""

from __future__ import annotations

import torch

FORMATS = ("dense", "fp8", "int4", "mxfp4")
FP8_DTYPE = torch.float8_e4m3fn


def weight_format(w: torch.Tensor, scale: torch.Tensor | None, zeros: torch.Tensor | None) -> str:
    """Which of FORMATS an expert weight (with its scale and zero points, if any) is in."""
    if scale is None:
        if zeros is not None:
            raise ValueError("expert weights: zero points without scales")
        return "dense"
    if w.dtype == FP8_DTYPE:
        return "fp8"
    if zeros is not None:
        return "int4"
    return "mxfp4"


def int4_group_size(w: torch.Tensor, scale: torch.Tensor) -> int:
    """G of an int4 weight: its K (2 codes a byte) over the groups its scale has."""
    return 2 * w.shape[-1] // scale.shape[-1]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] uint8 -> [..., K] int32 codes (low nibble first)."""
    p = packed.to(torch.int32)
    return torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes 0..15 -> [..., K / 2] uint8, the even k in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def dequantize(
    w: torch.Tensor, scale: torch.Tensor | None, zeros: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """An fp8 or int4 weight (one expert [rows, ...] or all [E, rows, ...]) -> dense [..., rows, K] in `dtype`;
    dense weights pass through (cast)."""
    fmt = weight_format(w, scale, zeros)
    if fmt == "dense":
        return w.to(dtype)
    assert scale is not None
    if fmt == "fp8":
        return (w.float() * scale.float()[..., None]).to(dtype)
    if fmt == "int4":
        assert zeros is not None
        group = int4_group_size(w, scale)
        q = unpack_int4(w).unflatten(-1, (-1, group))  # [..., rows, K / G, G]
        values = (q - zeros.to(torch.int32)[..., None]).float() * scale.float()[..., None]
        return values.flatten(-2).to(dtype)
    raise ValueError("MXFP4 experts run only in the fused-MoE kernel (dequantise them with mxfp4.dequantize_flat)")


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., rows, K] -> (w, scale, zeros) in the int4 layout: asymmetric min/max per group of K (the writer
    for tests and random-weight benchmarks; real checkpoints come quantized)."""
    g = weight.float().unflatten(-1, (-1, group_size))
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zeros[..., None]).clamp(0, 15)
    return pack_int4(q.flatten(-2)), scale.to(weight.dtype), zeros.to(torch.uint8)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, K] -> (fp8 w, float32 scale [..., rows]): amax / 448 per row (tests and benchmarks)."""
    scale = (weight.abs().amax(-1).float() / torch.finfo(FP8_DTYPE).max).clamp(min=1e-12)
    return (weight.float() / scale[..., None]).to(FP8_DTYPE), scale
