"""8-bit GPTQ checkpoints (AutoGPTQ / GPTQModel with `bits: 8`), dequantised to full precision as they load.

Per linear with K inputs and N outputs (AutoGPTQ's packing, as for 4 bits with bytes in place of nibbles):

    qweight  [K/4, N]   int32  four inputs per int32, byte i holds row 4r + i
    qzeros   [K/G, N/4] int32  four outputs per int32, byte i holds column 4c + i, stored as z - 1 ("gptq_v2": z)
    scales   [K/G, N]          (group_size -1: one group of all K inputs)
    g_idx    [K]               act order (desc_act): any row to any group; else k // G

and W[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n], with y = x @ W. Each linear's tensors are gathered in any
order and replaced by its `weight` [N, K]. The model then runs in its full-precision dtype: these weights take
two bytes each in bf16, twice the checkpoint's (no W8A16 kernel yet).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.services.engine.models.int4 import check_plain_g_idx, gptq_zero_offset, refuse_per_module_overrides

_PARTS = ("qweight", "qzeros", "scales")
_BYTE_SHIFTS = torch.arange(0, 32, 8, dtype=torch.int32)


def gptq8_format(cfg: dict[str, Any]) -> tuple[int, int] | None:
    """(group size, zero offset) of an 8-bit GPTQ checkpoint's config, or None. Group size 0: one group of each
    linear's inputs (GPTQ's -1); the offset is 1 for v1 checkpoints, which store each zero minus one."""
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "gptq" or qc.get("bits") != 8:
        return None
    refuse_per_module_overrides(qc)
    group_size = int(qc.get("group_size", 128))
    return max(group_size, 0), gptq_zero_offset(qc)


def unpack_bytes(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 holding four bytes (byte i = element 4c + i along `dim`, 0: rows, 1: columns) -> the int32 values."""
    values = (packed[..., None] >> _BYTE_SHIFTS.to(packed.device)) & 0xFF  # [R, C, 4]
    if dim == 0:
        return values.permute(0, 2, 1).reshape(-1, packed.shape[1])
    return values.reshape(packed.shape[0], -1)


def dequantize_gptq8(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zero_offset: int,
) -> torch.Tensor:
    """W [K, N] in float32 (group_size 0: one group)."""
    q = unpack_bytes(qweight, 0)
    zeros = unpack_bytes(qzeros, 1) + zero_offset
    k = q.shape[0]
    groups = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // (group_size or k)
    return (q - zeros[groups]).float() * scales.float()[groups]


def gptq8_stream(
    tensors: Iterable[tuple[str, torch.Tensor]], group_size: int, zero_offset: int, act_order: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint stream with each 8-bit linear's packed tensors replaced by its `weight` [N, K] (float32; the
    loader casts it). Under act order a linear waits for its g_idx; otherwise a g_idx must be the plain k // G.
    Tensors that do not fit together, or a linear left incomplete, raise ValueError naming them."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    plain_rows: dict[str, int] = {}  # converted linears (no act order): their K, to check a late g_idx
    for name, tensor in tensors:
        linear, _, part = name.rpartition(".")
        if part not in (*_PARTS, "g_idx"):
            yield name, tensor
            continue
        if linear in plain_rows:  # a g_idx after its linear was converted with plain groups
            check_plain_g_idx(name, tensor, plain_rows[linear], group_size)
            continue
        parts = pending.setdefault(linear, {})
        parts[part] = tensor
        if all(p in parts for p in _PARTS) and (not act_order or "g_idx" in parts):
            del pending[linear]
            weight = _dequantized(linear, parts, group_size, zero_offset, act_order)
            if not act_order:
                plain_rows[linear] = weight.shape[1]
            yield f"{linear}.weight", weight
    if pending:
        missing = {linear: sorted(set(_PARTS) - set(parts)) or ["g_idx"] for linear, parts in pending.items()}
        raise ValueError(f"8-bit GPTQ linears lack tensors: {dict(list(missing.items())[:4])}")


def _dequantized(
    linear: str, parts: dict[str, torch.Tensor], group_size: int, zero_offset: int, act_order: bool
) -> torch.Tensor:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    for part, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tensor.dtype != torch.int32 or tensor.dim() != 2:
            raise ValueError(f"{linear}.{part}: {tensor.dtype} {tuple(tensor.shape)}, not 2-D int32 (8-bit GPTQ)")
    k, n = qweight.shape[0] * 4, qweight.shape[1]
    num_groups = k // group_size if group_size else 1
    if group_size and k % group_size:
        raise ValueError(f"{linear}.qweight: {k} inputs do not split into groups of {group_size}")
    if tuple(scales.shape) != (num_groups, n):
        raise ValueError(f"{linear}.scales: shape {tuple(scales.shape)}, expected {(num_groups, n)} ({linear}.qweight)")
    if tuple(qzeros.shape) != (num_groups, n // 4) or n % 4:
        raise ValueError(f"{linear}.qzeros: shape {tuple(qzeros.shape)}, expected {(num_groups, n // 4)}")
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        if tuple(g_idx.shape) != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
            raise ValueError(f"{linear}.g_idx: shape {tuple(g_idx.shape)} or groups outside 0..{num_groups - 1}")
        if not act_order:
            check_plain_g_idx(f"{linear}.g_idx", g_idx, k, group_size)
    weight = dequantize_gptq8(qweight, qzeros, scales, g_idx if act_order else None, group_size, zero_offset)
    return weight.t().contiguous()  # [K, N] -> HF's [N, K]
