"""Mixture-of-experts MLPs in plain torch: the CPU path and the fused-MoE kernel's oracle.

    w13  [num_experts, 2 * intermediate, hidden]   rows [ gate | up ] per expert (w13_bias [E, 2 * I])
    w2   [num_experts, hidden, intermediate]                                         (w2_bias [E, hidden])
    out[t] = sum over slots s of topk_weights[t, s] * expert_mlp(topk_ids[t, s], x[t])

Activations on the gate/up pair:
    silu        silu(gate) * up                                       (Mixtral, Qwen2/3-MoE)
    swigluoai   g = min(gate, limit); u = clamp(up, -limit, limit);    (gpt-oss: its interleaved gate/up
                (u + 1) * g * sigmoid(alpha * g)                        columns are de-interleaved at load)

fp8 and int4 experts (w13/w2 with w13_scale/w2_scale, int4 also w13_zeros/w2_zeros, in kernels/expert_quant.py's
layouts) are dequantised one expert at a time as each runs: every path here takes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import expert_quant

ACTIVATIONS = ("silu", "swigluoai")


def check_activation(activation: str, swiglu_alpha: float | None, swiglu_limit: float | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoE activation {activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if activation == "swigluoai" and (swiglu_alpha is None or swiglu_limit is None):
        raise ValueError("MoE activation 'swigluoai' needs swiglu_alpha and swiglu_limit")


def gated_activation(
    gate_up: torch.Tensor,  # [num_rows, 2 * intermediate]
    activation: str = "silu",
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,  # fp8 / int4 experts (kernels/expert_quant.py)
    w2_scale: torch.Tensor | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_rows, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    assert swiglu_alpha is not None and swiglu_limit is not None
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(-swiglu_limit, swiglu_limit)
    return (up + 1) * gate * torch.sigmoid(gate * swiglu_alpha)


def expert_mlp(
    x: torch.Tensor,  # [num_rows, hidden]
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert: int,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,  # fp8 / int4 experts (kernels/expert_quant.py)
    w2_scale: torch.Tensor | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_rows, hidden]
    w13_e = _expert_weight(w13, w13_scale, w13_zeros, expert, x.dtype)
    gate_up = F.linear(x, w13_e, None if w13_bias is None else w13_bias[expert])
    hidden = gated_activation(gate_up, activation, swiglu_alpha, swiglu_limit)
    w2_e = _expert_weight(w2, w2_scale, w2_zeros, expert, x.dtype)
    return F.linear(hidden, w2_e, None if w2_bias is None else w2_bias[expert])


def _expert_weight(
    w: torch.Tensor, scale: torch.Tensor | None, zeros: torch.Tensor | None, expert: int, dtype: torch.dtype
) -> torch.Tensor:
    """Expert `expert`'s dense weight (quantized ones dequantised to `dtype`, dense ones as they are)."""
    if scale is None:
        return w[expert]
    return expert_quant.dequantize(w[expert], scale[expert], None if zeros is None else zeros[expert], dtype)


def experts_grouped(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,  # fp8 / int4 experts (kernels/expert_quant.py)
    w2_scale: torch.Tensor | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Assignments sorted by expert: each hit expert runs one matmul over its contiguous rows and unhit
    experts cost nothing. The per-expert row counts are read on the host (a sync: not for CUDA graphs)."""
    check_activation(activation, swiglu_alpha, swiglu_limit)
    quant = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_zeros=w13_zeros, w2_zeros=w2_zeros)
    top_k, num_experts = topk_ids.shape[1], w13.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    x_sorted = x[token_of]
    out_sorted = torch.empty_like(x_sorted)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            out_sorted[rows] = expert_mlp(
                x_sorted[rows], w13, w2, expert, activation, w13_bias, w2_bias, swiglu_alpha, swiglu_limit, **quant
            )
            start += count
    out_sorted = out_sorted * topk_weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, out_sorted)


def experts_loop(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,  # fp8 / int4 experts (kernels/expert_quant.py)
    w2_scale: torch.Tensor | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plainest MoE, the tests' oracle: for each expert, the tokens that chose it, weighted."""
    check_activation(activation, swiglu_alpha, swiglu_limit)
    quant = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_zeros=w13_zeros, w2_zeros=w2_zeros)
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        tokens, slots = (topk_ids == expert).nonzero(as_tuple=True)
        if tokens.numel():
            y = expert_mlp(
                x[tokens], w13, w2, expert, activation, w13_bias, w2_bias, swiglu_alpha, swiglu_limit, **quant
            )
            out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].to(x.dtype))
    return out


def experts_dense(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,  # fp8 / int4 experts (kernels/expert_quant.py)
    w2_scale: torch.Tensor | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every expert over every token, weighted by 0 where not chosen: no host sync, so a CUDA graph can
    capture it where the fused kernel is off. Slow (all experts' weights and FLOPs)."""
    check_activation(activation, swiglu_alpha, swiglu_limit)
    quant = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_zeros=w13_zeros, w2_zeros=w2_zeros)
    combine = torch.zeros(x.shape[0], w13.shape[0], dtype=x.dtype, device=x.device)
    combine.scatter_add_(1, topk_ids.to(torch.int64), topk_weights.to(x.dtype))  # [num_tokens, num_experts]
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        y = expert_mlp(x, w13, w2, expert, activation, w13_bias, w2_bias, swiglu_alpha, swiglu_limit, **quant)
        out += combine[:, expert : expert + 1] * y
    return out
