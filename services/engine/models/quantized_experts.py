"""MoE experts kept quantized on the device: fp8 (e4m3, a scale per output channel) or int4 (W4A16: AWQ, GPTQ
and compressed-tensors pack-quantized experts repacked at load), in kernels/expert_quant.py's layouts.

    Fp8Experts    gate_up_proj [E, 2I, hidden] fp8 + gate_up_proj_scale [E, 2I] fp32;  down_proj [E, hidden, I] ...
    Int4Experts   gate_up_proj [E, 2I, hidden / 2] uint8 + gate_up_proj_scale / _zeros [E, 2I, hidden / G];  down ...

On CUDA the fused-MoE kernel dequantises them in registers (kernels/fused_moe.py); elsewhere the torch paths
dequantise one expert at a time as it runs (kernels/moe_reference.py). Checkpoint names, per expert linear
(`experts.{i}.gate_proj.weight`, `.weight_scale`, `.weight_zeros`: what fp8 checkpoints hold, and what
int4.repack_experts makes of the 4-bit formats), load through `load_weight` by the shard ids of moe.Experts.

The loader decides the layout (`experts_quantization`): quantized on CUDA, dequantised at load elsewhere (the
torch paths run dense weights faster than dequantising per call), and always dense for act-order GPTQ
experts: their g_idx permutes K per expert, so a per-expert order of x's columns that one grouped GEMM over
all experts cannot follow.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from pagedserve.kernels import expert_quant, moe_reference
from pagedserve.services.engine.models.compressed_tensors import ignored, pack_quantized_format
from pagedserve.services.engine.models.int4 import int4_format, unconverted_linears
from pagedserve.services.engine.models.moe import Experts, fused_experts

# The config key the loader sets: {"format": "fp8" | "int4", "group_size": G (int4; 0: per output channel)},
# absent for dense experts.
QUANTIZED_EXPERTS_KEY = "quantized_experts"
INT4_METHODS = ("awq", "gptq", "compressed-tensors")


def experts_quantization(
    method: str, cfg: dict[str, Any], device: torch.device, quantized: bool | None
) -> dict[str, Any] | None:
    """The experts' in-memory format for a checkpoint loaded with `method` (loader.resolve_quantization), or
    None for dense. `quantized` forces it (True: tests run the quantized layout on CPU) or refuses it
    (False); None: quantized on CUDA only."""
    if method == "fp8":
        layout: dict[str, Any] = {"format": "fp8"}
    elif method in INT4_METHODS:
        why = "act-order (desc_act)" if int4_act_order(cfg) else None
        if why is None and (expert := first_unquantized_expert(method, cfg)) is not None:
            why = f"the checkpoint leaves {expert} unquantized:"
        if why is not None:
            if quantized:
                raise ValueError(f"{why} 4-bit experts are dequantised at load: they cannot stay 4-bit")
            return None
        layout = {"format": "int4", "group_size": int4_group_size(method, cfg)}
    else:
        return None
    keep = quantized if quantized is not None else device.type == "cuda"
    return layout if keep else None


def int4_act_order(cfg: dict[str, Any]) -> bool:
    """Whether a 4-bit checkpoint's config says its rows may be in act order (GPTQ desc_act, compressed-tensors
    actorder)."""
    qc = cfg.get("quantization_config") or {}
    if qc.get("desc_act"):
        return True
    groups = (qc.get("config_groups") or {}).values()
    return any((g.get("weights") or {}).get("actorder") not in (None, False) for g in groups)


def first_unquantized_expert(method: str, cfg: dict[str, Any]) -> str | None:
    """The first expert linear (checkpoint name) a 4-bit checkpoint's config leaves in full precision, or None:
    AWQ's `modules_to_not_convert` (e.g. ["model.layers.0."]), GPTQModel's "-:" rules, GPTQ's
    modules_in_block_to_quantize, compressed-tensors' ignore and targets. Plain weights cannot fill 4-bit experts,
    so such a model holds every expert dequantised (int4.dequantize_experts takes both kinds)."""
    if method == "compressed-tensors":
        scheme = pack_quantized_format(cfg)
        keep = ignored(scheme) if scheme is not None else None
    else:
        keep = unconverted_linears(cfg)
    if keep is None:
        return None
    if cfg.get("model_type") == "mixtral":
        block, projections = "block_sparse_moe", ("w1", "w3", "w2")
    else:
        block, projections = "mlp", ("gate_proj", "up_proj", "down_proj")
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    for layer in range(int(cfg.get("num_hidden_layers") or 0)):
        for expert in range(num_experts):
            for projection in projections:
                if keep(name := f"model.layers.{layer}.{block}.experts.{expert}.{projection}"):
                    return name
    return None


def int4_group_size(method: str, cfg: dict[str, Any]) -> int:
    if method == "compressed-tensors":
        scheme = pack_quantized_format(cfg)
        assert scheme is not None
        return scheme.group_size
    fmt = int4_format(cfg)
    assert fmt is not None
    return fmt[1]


def experts_class(cfg: dict[str, Any]) -> Any:
    """What MoE builds its experts with: moe.Experts, or a quantized one as the loader decided."""
    layout = cfg.get(QUANTIZED_EXPERTS_KEY)
    if layout is None:
        return Experts
    if layout["format"] == "fp8":
        return Fp8Experts
    return partial(Int4Experts, group_size=int(layout["group_size"]))


def _parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantizedExperts(Experts):
    """moe.Experts with quantized weights plus `{weight}_scale` (and int4's `{weight}_zeros`) parameters."""

    gate_up_proj_scale: nn.Parameter
    down_proj_scale: nn.Parameter

    def _quant(self) -> dict[str, torch.Tensor | None]:
        return dict(
            w13_scale=self.gate_up_proj_scale,
            w2_scale=self.down_proj_scale,
            w13_zeros=getattr(self, "gate_up_proj_zeros", None),
            w2_zeros=getattr(self, "down_proj_zeros", None),
        )

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.gate_up_proj, self.down_proj
        return moe_reference.expert_mlp(x, w13, w2, expert, self.activation, **self._quant())  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.gate_up_proj, self.down_proj
        return fused_experts(x, w13, w2, weights, ids, activation=self.activation, **self._quant())  # type: ignore[arg-type]

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """CUDA (graphs): the kernel, which has no host sync; elsewhere the dense torch path, per-call dequant."""
        if x.is_cuda:
            return self.forward(x, weights, ids)
        w13, w2 = self.gate_up_proj, self.down_proj
        return moe_reference.experts_dense(x, w13, w2, weights, ids, activation=self.activation, **self._quant())  # type: ignore[arg-type]

    def _rows(self, param_name: str, shard_id: str | None) -> tuple[slice | int, slice]:
        """(experts, rows) of `param_name` (gate_up_proj*, down_proj*) that a shard fills."""
        if shard_id is None:  # a fused 3-D tensor: every expert, every row
            return slice(None), slice(None)
        part, expert = shard_id.split(":")
        size = self.intermediate_size
        rows = {"gate": slice(0, size), "up": slice(size, 2 * size), "down": slice(None)}[part]
        return int(expert), rows

    def _target(self, param_name: str, shard_id: str | None) -> torch.Tensor:
        param = getattr(self, param_name, None)
        if param is None:
            raise ValueError(f"{param_name}: not a tensor of {type(self).__name__}")
        experts, rows = self._rows(param_name, shard_id)
        return param.data[experts, rows] if shard_id is not None else param.data

    @staticmethod
    def _copy(target: torch.Tensor, loaded: torch.Tensor, param_name: str) -> None:
        if target.shape != loaded.shape:
            raise ValueError(f"{param_name}: shape {tuple(loaded.shape)} does not fit {tuple(target.shape)}")
        target.copy_(loaded)


class Fp8Experts(QuantizedExperts):
    """Experts in float8_e4m3fn with a float32 scale per output channel. An fp8 checkpoint's per-tensor scales
    are repeated over their rows; full-precision weights (online `--quantization fp8`, or an expert an fp8
    checkpoint left unquantized) are quantized per row as they load."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, act)
        e, h, i = num_experts, hidden_size, intermediate_size
        fp8 = expert_quant.FP8_DTYPE
        self.gate_up_proj, self.down_proj = _parameter(e, 2 * i, h, dtype=fp8), _parameter(e, h, i, dtype=fp8)
        self.gate_up_proj_scale = _parameter(e, 2 * i, dtype=torch.float32)
        self.down_proj_scale = _parameter(e, h, dtype=torch.float32)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | None) -> list[str]:
        if param_name.endswith("_scale"):
            target = self._target(param_name, shard_id)  # [rows] of one expert's shard, or [E, rows]
            scale = loaded.float().reshape(-1).to(target.device)
            if scale.numel() == 1:  # per tensor: repeated over the rows
                target.copy_(scale.reshape([1] * target.dim()).expand_as(target))
            elif target.dim() == 2 and scale.numel() == target.shape[0]:  # a fused tensor's, per expert
                target.copy_(scale[:, None].expand_as(target))
            elif scale.numel() == target.numel():  # per output channel: [N], [N, 1], [E, N, 1]
                target.copy_(scale.reshape(target.shape))
            else:
                raise ValueError(f"{param_name}: {scale.numel()} scales for {tuple(target.shape)} rows")
            return [param_name]
        target = self._target(param_name, shard_id)
        if loaded.dtype == expert_quant.FP8_DTYPE:
            self._copy(target, loaded, param_name)
            return [param_name]
        q, scale = expert_quant.quantize_fp8(loaded.to(target.device))
        self._copy(target, q, param_name)
        self._target(f"{param_name}_scale", shard_id).copy_(scale)
        return [param_name, f"{param_name}_scale"]


class Int4Experts(QuantizedExperts):
    """Experts as 4-bit codes (two a byte along K, the low nibble first) with a scale and a zero point per
    group of `group_size` inputs (0: one group of all of a weight's inputs); int4.repack_experts gives each
    expert linear's `weight` (uint8 [N, K / 2]), `weight_scale` and `weight_zeros` ([N, K / G])."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str, group_size: int) -> None:
        super().__init__(num_experts, hidden_size, intermediate_size, act)
        self.group_size = group_size
        e, h, i, dtype = num_experts, hidden_size, intermediate_size, self.gate_up_proj.dtype
        g13, g2 = group_size or h, group_size or i
        if h % g13 or i % g2:
            raise ValueError(
                f"int4 experts: hidden {h} and intermediate {i} must be multiples of group size {group_size}"
            )
        u8 = torch.uint8
        self.gate_up_proj, self.down_proj = _parameter(e, 2 * i, h // 2, dtype=u8), _parameter(e, h, i // 2, dtype=u8)
        self.gate_up_proj_scale = _parameter(e, 2 * i, h // g13, dtype=dtype)
        self.gate_up_proj_zeros = _parameter(e, 2 * i, h // g13, dtype=u8)
        self.down_proj_scale = _parameter(e, h, i // g2, dtype=dtype)
        self.down_proj_zeros = _parameter(e, h, i // g2, dtype=u8)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | None) -> list[str]:
        if not param_name.endswith(("_scale", "_zeros")) and loaded.dtype != torch.uint8:
            raise ValueError(f"{param_name}: int4 experts take uint8 codes (int4.repack_experts), not {loaded.dtype}")
        self._copy(self._target(param_name, shard_id), loaded, param_name)
        return [param_name]
