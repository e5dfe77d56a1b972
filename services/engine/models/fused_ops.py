"""Fused elementwise ops the layers call: Triton kernels on CUDA, the plain torch ops elsewhere.

    add_rms_norm      residual += x; x = rmsnorm(residual)        (kernels/fused_norm.py; under tensor
                      parallelism x may be an unreduced partial, summed in the same kernel: all_reduce_norm.py)
    silu_and_mul      silu(gate) * up on the fused gate_up output  (kernels/silu_mul.py)
    rotary_and_attend rotary(q, k) + k/v to the paged cache, then attention  (kernels/rotary_kv_write.py;
                      a prefill attends to the new k/v in place: kernels/prefill_attention.py)

Per decoder layer this turns ~25 launches into ~9 (see bench/layer_kernels.py). The mode is a process
setting like the attention backend: "auto" fuses on CUDA when the Triton attention backend is active,
"on" also fuses on CPU tensors (tests run the kernels under TRITON_INTERPRET=1), "off" never fuses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedserve.services.engine import attention
from pagedserve.services.engine.parallel import partial_sums

if TYPE_CHECKING:
    from pagedserve.services.engine.attention import AttentionMetadata
    from pagedserve.services.engine.models.rotary import RotaryEmbedding

_MODES = ("auto", "on", "off")
_mode = "auto"


def set_fusion(mode: str) -> None:
    global _mode
    if mode not in _MODES:
        raise ValueError(f"fusion mode {mode!r} is not one of {', '.join(_MODES)}")
    _mode = mode


def fusion_mode() -> str:
    return _mode


def is_fused(x: torch.Tensor) -> bool:
    """Whether the layers take the fused path for tensors like `x` (Triton must be the attention backend,
    since the fused rotary writes the cache itself and hands only q to the Triton attention)."""
    if _mode == "off" or attention.backend_name() != "triton":
        return False
    return _mode == "on" or x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: fp32 inside, normed value rounded to x's dtype, then the weight."""
    if x.is_cuda:  # one fused kernel (fp32 inside) instead of seven: decode steps are launch-bound
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output (may be overwritten)
    residual: torch.Tensor | None,  # [num_tokens, hidden] or None before the first layer
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (rmsnorm(x + residual), x + residual)
    if is_fused(x):
        partials = partial_sums.owner_of(x) if residual is not None else None
        if partials is not None:  # x: this rank's addend of a row-parallel output; sum it in the same kernel
            return partials.finish_add_rms_norm(x, residual, weight, eps)  # type: ignore[arg-type]
        from pagedserve.kernels.fused_norm import add_rms_norm_

        return add_rms_norm_(x, residual, weight, eps)
    new_residual = x if residual is None else x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [n, 2I] -> [n, I]
    if is_fused(gate_up):
        from pagedserve.kernels.silu_mul import silu_mul

        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_and_attend(
    rotary: RotaryEmbedding,
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim] (a view of the qkv output: rotated in place)
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,  # an fp8 cache's scales
    v_scale: float = 1.0,
    window: int | None = None,  # the layer's sliding window
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if not is_fused(q):
        q, k = rotary(positions, q, k)
        return attention.paged_attention(q, k, v, kv_cache, meta, scale, k_scale, v_scale, window=window)
    from pagedserve.kernels import triton_backend
    from pagedserve.kernels.rotary_kv_write import rotary_write_kv_cache

    cos, sin = rotary.caches_for(q)
    rotary_write_kv_cache(positions, q, k, v, cos, sin, kv_cache, meta.slot_mapping, k_scale, v_scale)
    # k (rotated in place) and v still hold this step's keys/values unquantised: a prefill reads them there.
    return triton_backend.attend(q, kv_cache, meta, scale, k_scale, v_scale, key=k, value=v, window=window)
