"""Reordering a fused qkv linear's outputs (GPT-NeoX's, Falcon's per-head `query_key_value`) in whichever
layout each of its checkpoint tensors comes in, as they reach `checkpoint_to_params`.

A family knows how to reorder the output rows of a full-precision weight [N, K] (`reorder`: dim 0 of any
tensor of N rows). Each tensor permutes along its own output dimension:

    weight [N, K] (full precision, fp8, or dequantised at load), bias [N], weight_scale [N] / [N, 1]   dim 0
    weight_scale / input_scale of one element (per-tensor fp8)                            unchanged
    GPTQ  qweight [K/8, N], scales [K/G, N]                                               dim 1
    GPTQ  qzeros [K/G, N/8] (sequential nibbles)                                          unpacked along N
    AWQ   qweight [K, N/8], qzeros [K/G, N/8] (AWQ's nibble order, models/int4.py)        unpacked along N
    g_idx [K] (one per input)                                                             unchanged

compressed-tensors pack-quantized tensors arrive as GPTQ's (models/compressed_tensors.gptq_stream).
Packed tensors whose permutation moves whole packs of eight outputs (every head_dim a multiple of 8) move
their int32 columns; otherwise their nibbles are unpacked, permuted and repacked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedserve.services.engine.models.int4 import AWQ_ORDER, unpack_columns
from pagedserve.services.engine.models.int4_repack import pack_columns

# Reorders dim 0 (the fused linear's N outputs) of a tensor, e.g. gpt_neox.per_head_qkv_to_stacked.
OutputOrder = Callable[[torch.Tensor], torch.Tensor]


def int4_packing(cfg: dict[str, Any]) -> str:
    """How a checkpoint's 4-bit tensors (if any) pack their nibbles: "awq", else GPTQ's ("gptq")."""
    qc = cfg.get("quantization_config") or {}
    return "awq" if qc.get("quant_method") == "awq" else "gptq"


def reorder_outputs(param: str, tensor: torch.Tensor, reorder: OutputOrder, packing: str) -> torch.Tensor:
    """`tensor`, the fused linear's parameter `param` (qweight, scales, weight_scale, ...), with its outputs in
    `reorder`'s order; `packing` ("awq" or "gptq", `int4_packing`) says how 4-bit tensors are packed."""
    if param == "g_idx" or (param.endswith("_scale") and tensor.numel() == 1):
        return tensor  # per input / per tensor: nothing per output
    if param == "qzeros" or (param == "qweight" and packing == "awq"):
        return _reorder_packed_columns(tensor, reorder, packing)
    if param in ("qweight", "scales"):  # GPTQ's [K/8, N] and [K/G, N]: outputs along dim 1
        return tensor.index_select(1, _order(tensor.shape[1], reorder, tensor.device))
    return reorder(tensor)  # weight, bias, per-row weight_scale: outputs along dim 0


def _order(num_outputs: int, reorder: OutputOrder, device: torch.device) -> torch.Tensor:
    """The output permutation as indices: new output i is old output order[i]."""
    return reorder(torch.arange(num_outputs)).to(device)


def _reorder_packed_columns(packed: torch.Tensor, reorder: OutputOrder, packing: str) -> torch.Tensor:
    """[R, N/8] int32, eight outputs per int32 (AWQ's or GPTQ's nibble order) -> the same, outputs reordered."""
    order = _order(packed.shape[1] * 8, reorder, packed.device)
    packs = order.view(-1, 8)
    if torch.equal(packs, packs[:, :1] + torch.arange(8, device=order.device)) and bool((packs[:, 0] % 8 == 0).all()):
        return packed.index_select(1, packs[:, 0] // 8)  # whole packs move: their nibble order stays
    values = unpack_columns(packed, packing).index_select(1, order)  # [R, N] in output order
    if packing == "awq":  # nibble i of each pack holds its column AWQ_ORDER[i]
        values = values.view(values.shape[0], -1, 8)[..., list(AWQ_ORDER)].reshape(values.shape)
    return pack_columns(values)
