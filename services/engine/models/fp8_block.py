"""Block-wise FP8 checkpoints: e4m3 weights with one scale per [bn, bk] block of each weight [N, K].

    W[n, k] = w_q[n, k] * scale[n // bn, k // bk]      scale [ceil(N / bn), ceil(K / bk)] float32

Two spellings of the same layout:
- `quant_method: "fp8"` with `weight_block_size: [bn, bk]` (Qwen3-*-FP8, DeepSeek-V3): the scale is stored as
  `<linear>.weight_scale_inv` (a multiplier despite its name, as transformers' finegrained-fp8 reads it);
- compressed-tensors float 8-bit weights with `strategy: "block"` and `block_structure: [bn, bk]`: the scale is
  `<linear>.weight_scale`.

What we chose: each weight is dequantised exactly, as it streams in, to the serving dtype (the loader casts the
float32 this yields). Such models run with bf16's memory and speed: there is no block-scaled FP8 GEMM here yet.
Experts (per-expert linears in these checkpoints) are dequantised the same way. A weight without its scale, or a
scale of the wrong shape, fails at load naming the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from pagedserve.services.engine.models.fp8 import FP8_DTYPE, skip_input_scales


class BlockFp8(NamedTuple):
    block: tuple[int, int]  # (rows, columns) of the weight a scale covers
    scale_suffix: str  # the scale tensor's name after the linear's


def block_fp8_format(cfg: dict[str, Any]) -> BlockFp8 | None:
    """The checkpoint's block layout, or None (not block-wise FP8)."""
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") == "fp8" and qc.get("weight_block_size"):
        return BlockFp8(_block(qc["weight_block_size"], "weight_block_size"), "weight_scale_inv")
    if qc.get("quant_method") == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            is_fp8 = weights.get("type") == "float" and weights.get("num_bits") == 8
            if is_fp8 and weights.get("strategy") == "block":
                return BlockFp8(_block(weights.get("block_structure"), "block_structure"), "weight_scale")
    return None


def _block(value: Any, key: str) -> tuple[int, int]:
    if not isinstance(value, list | tuple) or len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value):
        raise ValueError(f"quantization: fp8 {key} {value!r} is not two positive block sizes [rows, columns]")
    return value[0], value[1]


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] e4m3 and [ceil(N/bn), ceil(K/bk)] scales -> the float32 weight they mean."""
    rows, cols = weight.shape
    per_row = scale.float().repeat_interleave(block[0], dim=0)[:rows]
    return weight.float() * per_row.repeat_interleave(block[1], dim=1)[:, :cols]


def block_fp8_stream(tensors: Iterable[tuple[str, torch.Tensor]], fmt: BlockFp8) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint stream with each fp8 `weight` and its block scale (in either order) replaced by the dequantised
    float32 `weight`; static activation scales dropped; other tensors pass through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in skip_input_scales(tensors):
        linear, _, part = name.rpartition(".")
        is_fp8_weight = part == "weight" and tensor.dtype == FP8_DTYPE
        if not is_fp8_weight and part != fmt.scale_suffix:
            yield name, tensor
            continue
        parts = pending.setdefault(linear, {})
        parts[part] = tensor
        if "weight" in parts and fmt.scale_suffix in parts:
            del pending[linear]
            yield f"{linear}.weight", _dequantized(linear, parts["weight"], parts[fmt.scale_suffix], fmt)
    if pending:
        missing = {linear: [fmt.scale_suffix] if "weight" in parts else ["weight"] for linear, parts in pending.items()}
        raise ValueError(f"block fp8 linears lack tensors: {dict(list(missing.items())[:4])}")


def _dequantized(linear: str, weight: torch.Tensor, scale: torch.Tensor, fmt: BlockFp8) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(f"{linear}.weight: shape {tuple(weight.shape)}, not a 2-D [out, in] fp8 weight")
    (rows, cols), (bn, bk) = weight.shape, fmt.block
    expected = (-(-rows // bn), -(-cols // bk))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{linear}.{fmt.scale_suffix}: shape {tuple(scale.shape)}, expected {expected} "
            f"(one scale per {bn}x{bk} block of the {rows}x{cols} weight)"
        )
    return dequantize_block_fp8(weight, scale, fmt.block)
