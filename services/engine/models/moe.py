"""Mixture-of-experts MLP: a router picks top-k experts per token; their gated MLPs are summed by weight.

    experts.gate_up_proj  [num_experts, 2 * moe_intermediate, hidden]   rows [ gate | up ] per expert
    experts.down_proj     [num_experts, hidden, moe_intermediate]

These are transformers 5's in-memory names; Hub checkpoints (and `save_pretrained`) store one
Linear per expert (`experts.{i}.gate_proj/up_proj/down_proj`, Mixtral's `experts.{i}.w1/w3/w2`),
which `Experts.load_shard` copies into expert i's slice (shard id "gate:i", "up:i", "down:i").

The experts run through `fused_experts`: the fused-MoE Triton kernel (kernels/fused_moe.py) where the
layers fuse (CUDA with the Triton backend), the torch path of kernels/moe_reference.py elsewhere. MXFP4
experts (gpt-oss kept packed) always take the kernel: the torch paths need dense weights. fp8 and int4 experts
(models/quantized_experts.py) take the kernel on CUDA, and elsewhere the torch paths, which dequantise them
one expert at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.kernels import moe_reference
from pagedserve.services.engine.models import fused_ops
from pagedserve.services.engine.models.layers import GatedMLP

SCORING = ("softmax", "sigmoid")
_ACTIVATION_ALIASES = {"swish": "silu"}  # config hidden_act names -> ours


def route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    scoring: str,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k])
    """Top-k experts per token and their weights, scored in fp32 like HF's routers (vLLM's fused_topk:
    softmax or sigmoid over all experts, then top-k, then optionally weights / their sum). gpt-oss's
    softmax over the top-k logits is softmax + renormalize."""
    if scoring not in SCORING:
        raise ValueError(f"MoE scoring {scoring!r} is not supported (supported: {', '.join(SCORING)})")
    scores = router_logits.float().softmax(-1) if scoring == "softmax" else router_logits.float().sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]  rows [ gate | up ]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    *,
    activation: str = "silu",  # or "swigluoai" (gpt-oss: needs swiglu_alpha and swiglu_limit)
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate]  [ gate | up ]
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    swiglu_alpha: float | None = None,
    swiglu_limit: float | None = None,
    w13_scale: torch.Tensor | None = None,  # MXFP4, fp8, int4: see kernels/expert_quant.py
    w2_scale: torch.Tensor | None = None,
    w13_zeros: torch.Tensor | None = None,  # int4
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, hidden]: sum over slots of weight x expert MLP
    """The experts as every MoE family calls them. Under tensor parallelism each rank passes its slice of
    the intermediate dim (w13's gate and up rows, w2's columns) and all-reduces the result."""
    quant = dict(w13_scale=w13_scale, w2_scale=w2_scale, w13_zeros=w13_zeros, w2_zeros=w2_zeros)
    is_mxfp4 = w13_scale is not None and w13.dtype == torch.uint8 and w13_zeros is None
    if is_mxfp4 or (w13_scale is not None and x.is_cuda):
        from pagedserve.kernels import fused_moe  # MXFP4: only the kernel reads it; fp8/int4 on CUDA: no graph sync

        return fused_moe.fused_experts(
            x,
            w13,
            w2,
            topk_weights,
            topk_ids,
            activation=activation,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
            swiglu_alpha=swiglu_alpha,
            swiglu_limit=swiglu_limit,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            w13_zeros=w13_zeros,
            w2_zeros=w2_zeros,
        )
    return _experts_path(x)(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        swiglu_alpha=swiglu_alpha,
        swiglu_limit=swiglu_limit,
        **quant,
    )


def _experts_path(x: torch.Tensor) -> Callable[..., torch.Tensor]:
    if fused_ops.is_fused(x):
        from pagedserve.kernels import fused_moe  # imported lazily: triton is absent on many CPU machines

        return fused_moe.fused_experts
    if x.is_cuda and torch.cuda.is_current_stream_capturing():  # the grouped path's counts need a host sync
        return moe_reference.experts_dense
    return moe_reference.experts_grouped


class Experts(nn.Module):
    """Every expert's gated MLP as two 3-D weights; `forward` computes only the experts tokens hit."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.activation = _ACTIVATION_ALIASES.get(act, act)
        moe_reference.check_activation(self.activation, 0.0, 0.0)  # refuse an unsupported config at start

    def load_shard(self, param_name: str, loaded: torch.Tensor, shard_id: str) -> None:
        part, expert = shard_id.split(":")
        size = self.intermediate_size
        if part == "down":
            self.down_proj.data[int(expert)].copy_(loaded)
            return
        start = 0 if part == "gate" else size
        assert loaded.shape[0] == size, (param_name, shard_id, tuple(loaded.shape))
        self.gate_up_proj.data[int(expert), start : start + size].copy_(loaded)

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return moe_reference.expert_mlp(x, self.gate_up_proj, self.down_proj, expert, self.activation)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        weights: torch.Tensor,  # [num_tokens, top_k] float32
        ids: torch.Tensor,  # [num_tokens, top_k] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, activation=self.activation)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The CUDA-graph path without the fused kernel (see moe_reference.experts_dense)."""
        w13, w2 = self.gate_up_proj, self.down_proj
        return moe_reference.experts_dense(x, w13, w2, weights, ids, activation=self.activation)


def experts_reference(experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The plainest MoE: every token, every chosen slot, its expert's MLP (the tests' oracle)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            out[t] += weights[t, slot].to(x.dtype) * experts.expert_mlp(int(ids[t, slot]), x[t : t + 1])[0]
    return out


class MoE(nn.Module):
    """Router (`gate`) + experts, and Qwen2-MoE's always-on shared expert scaled by sigmoid(shared_expert_gate)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        act: str,
        renormalize: bool,
        scoring: str = "softmax",
        shared_intermediate_size: int = 0,
        experts_class: Callable[[int, int, int, str], Experts] = Experts,  # quantized_experts.experts_class
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.scoring = top_k, renormalize, scoring
        route(torch.zeros(1, num_experts, device="cpu"), top_k, scoring, renormalize)  # refuse bad configs now
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = experts_class(num_experts, hidden_size, intermediate_size, act)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act) if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by parallel/sharding.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        weights, ids = route(self.gate(x), self.top_k, self.scoring, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.reduce is not None:  # tensor parallel: each rank summed its slice of every expert
            out = self.reduce(out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
