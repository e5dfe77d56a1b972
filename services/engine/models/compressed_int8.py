"""compressed-tensors checkpoints of 8-bit int weights, dequantised to full precision as they load:
W8A8-INT8 ("int-quantized", llm-compressor's `*-quantized.w8a8`) and W8A16 ("pack-quantized" with 8 bits).

Per linear with K inputs and N outputs (compressed_tensors' naive / pack_quantized compressors):

    weight             [N, K] int8           int-quantized: the signed values q (-128..127)
    weight_packed      [N, K/4] int32        pack-quantized: four inputs per int32, value i at bits 8i, stored q + 128
    weight_scale       [1] / [N, 1] / [N, K/G]   strategy tensor / channel / group
    weight_zero_point  as weight_scale       asymmetric only (int-quantized: int8; pack-quantized: [N/4, K/G] int32
                                             packed along the outputs, stored z + 128)
    weight_shape       [2]                   pack-quantized: (N, K)
    weight_g_idx       [K] int               strategy group, actorder "group": the group of each input
    input_scale, input_zero_point            static activation quantization: dropped (below)

and W[n, k] = (q[n, k] - z) * s for the scale and zero of (n, k)'s tensor, channel or group (group k // G, or
g_idx[k] where the checkpoint has one: act order assigns inputs to groups out of order). Each linear's
tensors are gathered in any order and replaced by its `weight` [N, K]; the model runs in its full-precision dtype
(two bytes a weight in bf16: no int8 kernel yet) and its activations are not quantized, so it computes the
checkpoint's weights more exactly than an int8 x int8 GEMM would.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.services.engine.models.compressed_tensors import group_act_order, refuse_mixed_schemes, weight_groups
from pagedserve.services.engine.models.gptq8 import unpack_bytes

METHOD = "compressed-tensors"
FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
_QUANTIZED_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
_ACTIVATION_PARTS = ("input_scale", "input_zero_point")


@dataclass(frozen=True)
class Int8Weights:
    packed: bool  # pack-quantized (int32 words) rather than int8 tensors
    group_size: int  # strategy group; 0: tensor or channel (the scale's shape says which)
    symmetric: bool
    ignore: tuple[str, ...]
    act_order: bool = False  # actorder "group": every linear has a weight_g_idx


def int8_weights_format(cfg: dict[str, Any]) -> Int8Weights | None:
    """The scheme of a compressed-tensors checkpoint with 8-bit int weights, or None (another method or width)."""
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != METHOD:
        return None
    named = weight_groups(qc)
    groups = list(named.values())
    schemes = [g["weights"] for g in groups]
    if not schemes or any(s.get("type", "int") != "int" or s.get("num_bits") != 8 for s in schemes):
        return None
    refuse_mixed_schemes(named)
    weights = schemes[0]
    formats = {g.get("format") or qc.get("format") for g in groups}
    if len(formats) != 1 or not formats <= set(FORMATS):
        raise ValueError(
            f"quantization: compressed-tensors 8-bit weights in format {sorted(map(str, formats))} "
            f"are not supported ({', '.join(FORMATS)})"
        )
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "group"):
        raise ValueError(
            f"quantization: compressed-tensors 8-bit weights with strategy {strategy!r} are not supported "
            "(tensor, channel, group)"
        )
    group_size = int(weights.get("group_size") or 0) if strategy == "group" else 0
    if strategy == "group" and group_size <= 0:
        raise ValueError(f"quantization: compressed-tensors group strategy with group_size {group_size}")
    return Int8Weights(
        formats == {"pack-quantized"},
        group_size,
        bool(weights.get("symmetric", True)),
        tuple(qc.get("ignore") or ()),
        group_act_order(weights) and group_size > 0,
    )


def unpack_int8(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """pack_to_int32's 8-bit words (value i at bits 8i, stored + 128) along `dim` (1: the inputs) -> signed values:
    GPTQ's byte packing (gptq8.unpack_bytes) less the offset."""
    return unpack_bytes(packed, dim) - 128


def dequantize_int8(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int, g_idx: torch.Tensor | None = None
) -> torch.Tensor:
    """W [N, K] float32 from the signed values q [N, K] and a scale (and zero) per tensor, channel or group (input k
    in group k // group_size, or g_idx[k])."""
    scale, zero = scale.float(), None if zero is None else zero.float()
    if group_size:  # [N, K/G] -> one per input
        groups = g_idx.long() if g_idx is not None else torch.arange(q.shape[1]) // group_size
        scale = scale[:, groups]
        zero = None if zero is None else zero[:, groups]
    shifted = q.float() if zero is None else q.float() - zero
    return shifted * scale


def int8_stream(tensors: Iterable[tuple[str, torch.Tensor]], scheme: Int8Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint stream with each 8-bit linear's tensors replaced by its float32 `weight` [N, K] (the loader
    casts it). Linears the checkpoint left in full precision (its `ignore`) pass through: their `weight` is float.
    Tensors that do not fit together, or a linear left incomplete, raise ValueError naming them."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    needed = (
        ("weight_packed" if scheme.packed else "weight", "weight_scale")
        + (() if scheme.symmetric else ("weight_zero_point",))
        + (("weight_g_idx",) if scheme.act_order else ())
    )
    for name, tensor in tensors:
        linear, _, part = name.rpartition(".")
        if part in _ACTIVATION_PARTS:
            continue  # activations are not quantized here (module docstring)
        quantized_weight = part == "weight" and not scheme.packed and tensor.dtype == torch.int8
        if part not in _QUANTIZED_PARTS and not quantized_weight:
            yield name, tensor
            continue
        if linear in done:  # a weight_g_idx the config did not announce (actorder "group"), after the rest
            hint = "; the config's actorder is not 'group'" if part == "weight_g_idx" else ""
            raise ValueError(f"{name}: came after {linear}'s tensors were complete{hint}")
        parts = pending.setdefault(linear, {})
        parts[part] = tensor
        if all(p in parts for p in needed) and (not scheme.packed or "weight_shape" in parts):
            del pending[linear]
            done.add(linear)
            yield f"{linear}.weight", _dequantized(linear, parts, scheme)
    if pending:
        missing = {linear: sorted(set(needed) - set(parts)) or ["weight_shape"] for linear, parts in pending.items()}
        raise ValueError(f"8-bit compressed-tensors linears lack tensors: {dict(list(missing.items())[:4])}")


def _dequantized(linear: str, parts: dict[str, torch.Tensor], scheme: Int8Weights) -> torch.Tensor:
    def fail(part: str, problem: str) -> ValueError:
        return ValueError(f"{linear}.{part}: {problem}")

    if scheme.packed:
        packed = parts["weight_packed"]
        if packed.dtype != torch.int32 or packed.dim() != 2:
            raise fail("weight_packed", f"{packed.dtype} {tuple(packed.shape)}, expected 2-D int32")
        q = unpack_int8(packed, 1)
        shape = tuple(int(v) for v in parts["weight_shape"].flatten())
        if len(shape) != 2 or shape[0] != q.shape[0] or not 0 < shape[1] <= q.shape[1]:
            raise fail("weight_shape", f"{shape} does not fit weight_packed {tuple(packed.shape)}")
        q = q[:, : shape[1]]
    else:
        q = parts["weight"]
        if q.dim() != 2:
            raise fail("weight", f"shape {tuple(q.shape)}, expected [outputs, inputs]")
    n, k = q.shape
    groups = k // scheme.group_size if scheme.group_size else 1
    scale = parts["weight_scale"]
    if scale.numel() == 1:  # strategy tensor
        scale = scale.reshape(1, 1)
    elif tuple(scale.shape) != (n, groups) or (scheme.group_size and k % scheme.group_size):
        raise fail("weight_scale", f"shape {tuple(scale.shape)}, expected {(n, groups)} (weight {(n, k)})")
    zero = parts.get("weight_zero_point") if not scheme.symmetric else None
    if zero is not None:
        if scheme.packed and zero.numel() > 1:
            zero = unpack_int8(zero, 0)[:n]
        zero = zero.reshape(scale.shape) if zero.numel() == scale.numel() else zero
        if zero.shape != scale.shape:
            raise fail(
                "weight_zero_point", f"shape {tuple(zero.shape)}, expected that of weight_scale {tuple(scale.shape)}"
            )
    g_idx = parts.get("weight_g_idx") if scheme.group_size else None  # tensor / channel: one group of all inputs
    if g_idx is not None and (
        g_idx.dim() != 1
        or g_idx.numel() != k
        or g_idx.dtype.is_floating_point
        or not bool(((g_idx >= 0) & (g_idx < groups)).all())
    ):
        raise fail("weight_g_idx", f"{g_idx.dtype} {tuple(g_idx.shape)}, expected [{k}] group indices below {groups}")
    return dequantize_int8(q, scale, zero, scheme.group_size, g_idx)
