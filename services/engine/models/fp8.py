"""FP8 (e4m3) weights: per-output-channel scales, dynamic per-token activation scales, `torch._scaled_mm`.

    y = (x_q * x_scale[:, None]) @ (w_q * w_scale[:, None]).T      x_q, w_q in float8_e4m3fn
      = _scaled_mm(x_q, w_q.T, scale_a=x_scale [M, 1], scale_b=w_scale [1, N])

Two ways in, one module (`Fp8Linear`), chosen at load (`quantize_linears`):
- a bf16/fp16/fp32 checkpoint with `quantization="fp8"`: each weight (or fused shard) is quantised as it
  is loaded, one scale per output row (amax / 448), so the full-precision weight never sits on the GPU;
- a pre-quantised checkpoint in the common HF layout (`quantization_config.quant_method` "fp8" or
  "compressed-tensors"): `weight` in float8_e4m3fn plus `weight_scale` (per tensor, or per row as [N] or
  [N, 1]); a per-tensor scale is repeated over the shard's rows, so fused q/k/v with three scales load
  exactly. A static `input_scale` is not needed (activations are scaled per token) and is skipped. Linears
  the checkpoint left unquantized (`ignored_layers`, `modules_to_not_convert`, compressed-tensors' `ignore`:
  `fp8_kept_linears`) stay full-precision linears, their weights loaded as they are.
CPU runs the same `_scaled_mm` where this torch build has it, else dequantises: the CPU tests check the
quantise/load/matmul logic with the GPU's arithmetic.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.services.engine.models.int4 import whole_linears
from pagedserve.services.engine.models.layers import replace_decoder_linears

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row or token gets a tiny scale, not 0/0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, K] fp8, [N] fp32)
    """One scale per row: amax / 448, so the row's largest value maps to fp8's largest."""
    scale = (x.abs().amax(dim=-1).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def checkpoint_is_fp8(cfg: dict[str, Any]) -> bool:
    qc = cfg.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method == "fp8":
        return True
    if method == "compressed-tensors":  # float-quantized weights with 8 bits
        groups = (qc.get("config_groups") or {}).values()
        return any(
            (g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 8
            for g in groups
        )
    return False


@cache
def _has_scaled_mm(device_type: str, out_dtype: torch.dtype) -> bool:
    """Whether this build/device has row-wise scaled fp8 matmul for `out_dtype` (CUDA: bf16 output only)."""
    try:
        a = torch.zeros((16, 16), dtype=FP8_DTYPE, device=device_type)
        one = torch.ones((16, 1), dtype=torch.float32, device=device_type)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t().contiguous(), out_dtype=out_dtype)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    if x.is_cuda:  # one Triton launch instead of ~6 torch ops per linear
        from pagedserve.kernels.fp8_quant import quantize_rows_fp8

        x_q, x_scale = quantize_rows_fp8(x)
    else:
        x_q, x_scale = quantize_rows(x)
    if _has_scaled_mm(x.device.type, x.dtype):
        out = torch._scaled_mm(
            x_q, weight.t(), scale_a=x_scale[:, None], scale_b=weight_scale[None, :], out_dtype=x.dtype
        )
    else:  # the same quantised operands, dequantised
        x_dq = x_q.float() * x_scale[:, None]
        out = F.linear(x_dq, weight.float() * weight_scale[:, None]).to(x.dtype)
    return out if bias is None else out + bias


class Fp8Linear(nn.Module):
    """A linear layer with an fp8 weight [N, K] and per-row scales [N]; may hold fused shards (q/k/v)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        shard_offsets: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty((out_features, in_features), dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.shard_offsets = shard_offsets or {}

    @classmethod
    def like(cls, linear: nn.Linear) -> Fp8Linear:
        """An empty Fp8Linear of `linear`'s shape (same device, e.g. meta)."""
        with linear.weight.device:
            return cls(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                linear.weight.dtype,
                getattr(linear, "shard_offsets", None),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = fp8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale, self.bias)
        return out.view(*lead, self.out_features)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W without the bias (a row-parallel shard adds it once, after the all-reduce)."""
        lead = x.shape[:-1]
        out = fp8_linear(x.reshape(-1, self.in_features), self.weight, self.weight_scale, None)
        return out.view(*lead, self.out_features)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: str | None) -> list[str]:
        """Copy a checkpoint tensor (or one fused shard of it) in; returns the parameter names written."""
        start, size = self.shard_offsets[shard_id] if shard_id is not None else (0, self.out_features)
        rows = slice(start, start + size)
        if param_name == "bias":
            assert self.bias is not None and loaded.shape == (size,), (shard_id, tuple(loaded.shape))
            self.bias.data[rows].copy_(loaded)
            return ["bias"]
        if param_name == "weight_scale":  # per tensor [] / [1], or per row [N] / [N, 1]
            self.weight_scale.data[rows].copy_(
                loaded.float().reshape(-1).expand(size) if loaded.numel() == 1 else loaded.float().reshape(size)
            )
            return ["weight_scale"]
        assert param_name == "weight" and loaded.shape == (size, self.in_features), (shard_id, tuple(loaded.shape))
        if loaded.dtype == FP8_DTYPE:
            self.weight.data[rows].copy_(loaded)
            return ["weight"]
        q, scale = quantize_rows(loaded.to(self.weight.device))
        self.weight.data[rows].copy_(q)
        self.weight_scale.data[rows].copy_(scale)
        return ["weight", "weight_scale"]


def quantize_linears(model: nn.Module, keep: Callable[[str], bool] | None = None) -> int:
    """Swap every nn.Linear inside the decoder layers, MoE routers aside, for an (empty) Fp8Linear; returns how
    many. Called on the meta-device model before loading. Embeddings and lm_head stay in full precision, and so
    do MoE experts (3-D tensors, not linears) and the linears `keep` names (full module names, e.g.
    model.layers.0.mlp.down_proj: what an FP8 checkpoint left unquantized, `fp8_kept_linears`)."""
    return replace_decoder_linears(model, lambda _, linear: Fp8Linear.like(linear), keep)


def fp8_kept_linears(cfg: dict[str, Any]) -> Callable[[str], bool] | None:
    """Which of our linears an FP8 checkpoint left in full precision (their plain `weight` loads as is), or None:
    HF fp8's `ignored_layers` (vLLM's key) and compressed-tensors' `ignore` (module names, or "re:<regex>" matched
    from the start), and `modules_to_not_convert` (transformers: a module whose name contains one, or "re:").
    A fused linear (qkv_proj, gate_up_proj) is kept when all its checkpoint parts are, or the checkpoint names it
    fused (Phi-3); parts that disagree raise ValueError. None also for a checkpoint that is not FP8 (online
    quantization of a full-precision checkpoint quantizes every decoder linear)."""
    if not checkpoint_is_fp8(cfg):
        return None
    qc = cfg.get("quantization_config") or {}
    named = [str(n) for key in ("ignored_layers", "ignore") for n in qc.get(key) or ()]
    contained = [str(n) for n in qc.get("modules_to_not_convert") or ()]
    patterns = [re.compile(n[3:]) for n in (*named, *contained) if n.startswith("re:")]
    exact = {n for n in named if not n.startswith("re:")}
    substrings = [n for n in contained if not n.startswith("re:")]
    if not patterns and not exact and not substrings:
        return None

    def is_kept(name: str) -> bool:
        return name in exact or any(s in name for s in substrings) or any(p.match(name) is not None for p in patterns)

    return whole_linears(is_kept, "ignored layers")


def skip_input_scales(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop static activation scales and fbgemm's activation bound (`input_scale_ub`: activations quantize
    dynamically per token here, by their own maximum) from a checkpoint stream. (KV-cache scales never get here:
    the loader takes them first, models/kv_cache_scales.py.)"""
    for name, tensor in tensors:
        if not name.endswith((".input_scale", ".input_scale_ub")):
            yield name, tensor


def e4m3_only(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's stream, refusing (by name) any 8-bit float tensor that is not e4m3 (float8_e4m3fn): an
    e5m2 weight's scale is for e5m2's range, so read as e4m3 (or requantized) it would load as garbage."""
    for name, tensor in tensors:
        if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1 and tensor.dtype != FP8_DTYPE:
            raise ValueError(f"{name}: {tensor.dtype} weights are not supported (FP8 checkpoints in e4m3 only)")
        yield name, tensor


def dequantize_experts(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """FP8 checkpoints of MoE models (Qwen3-30B-A3B-FP8, Mixtral FP8) quantise the experts too; ours hold
    full-precision experts (the fused-MoE kernel has no fp8 path yet), so each expert `weight` is dequantised
    with its `weight_scale` (per tensor or per row) as the pair streams in, in either order."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if ".experts." not in name or not name.endswith((".weight", ".weight_scale")):
            yield name, tensor
            continue
        weight_name = name.removesuffix("_scale")
        pair = pending.setdefault(weight_name, {})
        pair["scale" if name.endswith("_scale") else "weight"] = tensor
        if "weight" in pair and (pair["weight"].dtype != FP8_DTYPE or "scale" in pair):
            del pending[weight_name]
            yield weight_name, _dequantized(weight_name, pair["weight"], pair.get("scale"))
    if pending:
        raise ValueError(f"fp8 experts: {sorted(pending)[:4]} lack their weight or weight_scale")


def _dequantized(name: str, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:  # a full-precision expert in an fp8 checkpoint
        return weight
    scale = scale.float()
    if scale.numel() != 1:
        scale = scale.reshape(*weight.shape[:-1], 1)  # one per output row: [N], [N, 1], [E, N, 1]
        if scale.numel() != weight[..., :1].numel():
            raise ValueError(f"{name}_scale: {scale.numel()} scales for a weight of shape {tuple(weight.shape)}")
    return weight.float() * scale
