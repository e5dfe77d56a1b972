"""4-bit AWQ and GPTQ tensors written from the formats' specifications (AutoAWQ's GEMM packing, AutoGPTQ's
v1 packing), independently of the loader's unpacking: what a downloaded checkpoint holds."""

from __future__ import annotations

import numpy as np
import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i <- column AWQ_PACK_ORDER[i] of the eight


def quantize(
    weight: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [K, N] float -> (q [K, N], zeros [K/G, N], scales [K/G, N]): asymmetric 4-bit per group of rows."""
    k = weight.shape[0]
    groups = g_idx.long() if g_idx is not None else torch.arange(k) // group_size
    num_groups = k // group_size
    lo = torch.stack([weight[groups == g].min(dim=0).values for g in range(num_groups)])
    hi = torch.stack([weight[groups == g].max(dim=0).values for g in range(num_groups)])
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(weight / scales[groups] + zeros[groups]).clamp(0, 15)
    return q.to(torch.int64), zeros.to(torch.int64), scales


def _to_int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((values & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def pack_columns(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, N] 4-bit -> [R, N/8] int32, nibble i <- column 8c + order[i]."""
    v = values.numpy().astype(np.int64)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.int64)
    for i, column in enumerate(order):
        packed |= v[:, column::8] << (4 * i)
    return _to_int32(packed)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[K, N] 4-bit -> [K/8, N] int32, nibble i <- row 8r + i (GPTQ)."""
    v = values.numpy().astype(np.int64)
    packed = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.int64)
    for i in range(8):
        packed |= v[i::8, :] << (4 * i)
    return _to_int32(packed)


def _meaning(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """W [K, N] float32 as the format defines it: (q - zero) * scale, from the quantizer's own values."""
    return (q - zeros[groups]).float() * scales[groups].float()


def awq_tensors(weight: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors, the W they mean)."""
    q, zeros, scales = quantize(weight, group_size)
    scales = scales.half()
    tensors = {
        "qweight": pack_columns(q, AWQ_PACK_ORDER),
        "qzeros": pack_columns(zeros, AWQ_PACK_ORDER),
        "scales": scales,
    }
    return tensors, _meaning(q, zeros, scales, torch.arange(weight.shape[0]) // group_size)


def gptq_tensors(
    weight: torch.Tensor,
    group_size: int,
    act_order: bool = False,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ v1 (zeros stored minus one); act order assigns rows to groups in a random order."""
    k = weight.shape[0]
    groups = torch.arange(k) // group_size
    g_idx = None
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = groups.to(torch.int32)
        groups = g_idx.long()
    q, zeros, scales = quantize(weight, group_size, g_idx)
    scales = scales.half()
    tensors = {"qweight": pack_rows(q), "qzeros": pack_columns(zeros - 1), "scales": scales}
    if g_idx is not None:
        tensors["g_idx"] = g_idx
    return tensors, _meaning(q, zeros, scales, groups)
