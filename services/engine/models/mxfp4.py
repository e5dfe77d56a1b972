"""MXFP4 (OCP microscaling, FP4 E2M1 values with a shared E8M0 scale per 32), as gpt-oss ships its experts.

Per weight [rows, cols] (rows = output features) the checkpoint stores

    {name}_blocks  uint8 [..., rows, cols / 32, 16]  two 4-bit codes a byte, the low nibble first
    {name}_scales  uint8 [..., rows, cols / 32]      the block's power of two, biased by 127

and means  W[r, 32 b + j] = FP4[code j of block (r, b)] * 2 ** (scale[r, b] - 127).  A code is sign (bit 3)
and magnitude (bits 0-2): 0, 0.5, 1, 1.5, 2, 3, 4, 6. Every such value times a power of two is exact in
bf16, so dequantising at load loses nothing. The fused-MoE kernel also takes the codes as they are, the
blocks flattened to [..., rows, cols / 2] ("flat": `quantize_flat`, `dequantize_flat`), and dequantises
in registers (kernels/fused_moe.py).
"""

from __future__ import annotations

from typing import Any

import torch

BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAGNITUDES = torch.tensor(FP4_VALUES[:8])


# The config key the loader sets for the family: keep the experts packed (True) or dequantise them at load.
PACKED_EXPERTS_KEY = "mxfp4_packed_experts"


def checkpoint_is_mxfp4(cfg: dict[str, Any]) -> bool:
    return (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def keeps_experts_packed(device: torch.device, packed: bool | None, cfg: dict[str, Any]) -> bool:
    """`packed` if given. Else dequantised wherever the bf16 experts take at most half the device's memory:
    the fused-MoE kernel on bf16 weights ran 2.2-2.7x faster than on packed ones (H200, bench moe_kernel
    --mxfp4); packed on CUDA beyond that (gpt-oss-120b: ~230 GB of bf16 experts). The torch expert paths of
    the other devices need dense weights."""
    if packed is not None:
        return packed
    if device.type != "cuda":
        return False
    return dense_expert_bytes(cfg) > torch.cuda.get_device_properties(device).total_memory // 2


def dense_expert_bytes(cfg: dict[str, Any]) -> int:
    """The experts' bytes in bf16: per layer and expert, gate/up [2I, H] and down [H, I]."""
    per_expert = 3 * int(cfg["intermediate_size"]) * int(cfg["hidden_size"])
    return 2 * per_expert * int(cfg["num_local_experts"]) * int(cfg["num_hidden_layers"])


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., rows, cols/32, 16] uint8 codes and [..., rows, cols/32] uint8 scales -> [..., rows, cols]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8 (got {blocks.dtype} and {scales.dtype})")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
            f"(want [..., n, {BLOCK // 2}] and [..., n])"
        )
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., n, 32]: low nibble first
    values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)[codes.long()]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponents[..., None].to(torch.float32))
    return out.flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (blocks, scales) in the checkpoint layout; round to nearest FP4 value (ties to the
    lower magnitude) under the smallest power of two that keeps the block's largest value within 6. The
    writer for tests and random-weight benchmarks: real checkpoints come quantized."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4: {weight.shape[-1]} columns are not a multiple of {BLOCK}")
    w = weight.float().unflatten(-1, (-1, BLOCK))  # [..., n, 32]
    amax = w.abs().amax(-1)
    exponents = torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = w / torch.exp2(exponents)[..., None]
    magnitudes = _MAGNITUDES.to(w.device)
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)  # first (lower) of two equal distances
    codes = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponents + SCALE_BIAS).to(torch.uint8)


def dequantize_flat(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The kernel's layout: [..., rows, cols/2] uint8 codes and [..., rows, cols/32] scales -> [..., rows, cols]."""
    return dequantize(codes.unflatten(-1, (-1, BLOCK // 2)), scales, dtype)


def quantize_flat(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (codes [..., rows, cols/2], scales [..., rows, cols/32]), as the kernel takes them."""
    blocks, scales = quantize(weight)
    return blocks.flatten(-2), scales


def random_flat(shape: tuple[int, ...], scales: bool, generator: torch.Generator) -> torch.Tensor:
    """Random codes (uniform bytes) or scales (2^-9..2^-6: |w| up to ~0.1, about gpt-oss's) in the kernel's
    layout, for random-weight benchmarks."""
    low, high = (SCALE_BIAS - 9, SCALE_BIAS - 5) if scales else (0, 256)
    return torch.randint(low, high, shape, generator=generator, device=generator.device, dtype=torch.uint8)
