"""Mixture-of-experts MLP: a router picks top-k experts per token; their gated MLPs are summed by weight.

    experts.gate_up_proj  [num_experts, 2 * moe_intermediate, hidden]   rows [ gate | up ] per expert
    experts.down_proj     [num_experts, hidden, moe_intermediate]

These are transformers 5's in-memory names; Hub checkpoints (and `save_pretrained`) store one
Linear per expert (`experts.{i}.gate_proj/up_proj/down_proj`, Mixtral's `experts.{i}.w1/w3/w2`),
which `Experts.load_shard` copies into expert i's slice (shard id "gate:i", "up:i", "down:i").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.services.engine.models.layers import GatedMLP, get_activation

SCORING = ("softmax", "sigmoid")


def route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    scoring: str,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # (weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k])
    """Top-k experts per token and their weights, scored in fp32 like HF's routers."""
    if scoring not in SCORING:
        raise ValueError(f"MoE scoring {scoring!r} is not supported (supported: {', '.join(SCORING)})")
    scores = router_logits.float().softmax(-1) if scoring == "softmax" else router_logits.float().sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


class Experts(nn.Module):
    """Every expert's gated MLP as two 3-D weights; `forward` computes only the experts tokens hit."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = get_activation(act)

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
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[expert])

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        weights: torch.Tensor,  # [num_tokens, top_k] float32
        ids: torch.Tensor,  # [num_tokens, top_k] int64
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward_dense(x, weights, ids)  # the per-expert counts below need a host sync
        # Sort the (token, slot) pairs by expert: each hit expert then runs one matmul over a
        # contiguous block of rows, and unhit experts cost nothing (no dense all-experts compute).
        top_k = ids.shape[1]
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)
        token_of = order // top_k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        x_sorted = x[token_of]
        out_sorted = torch.empty_like(x_sorted)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                out_sorted[start : start + count] = self.expert_mlp(expert, x_sorted[start : start + count])
                start += count
        out_sorted = out_sorted * weights.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, out_sorted)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert over every token, weighted by 0 where not chosen: no host sync, so CUDA graphs
        can capture it (decode batches); slow, until the fused-MoE Triton kernel replaces it."""
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        combine.scatter_add_(1, ids, weights.to(x.dtype))  # [num_tokens, num_experts]
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            out += combine[:, expert : expert + 1] * self.expert_mlp(expert, x)
        return out


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
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.scoring = top_k, renormalize, scoring
        route(torch.zeros(1, num_experts, device="cpu"), top_k, scoring, renormalize)  # refuse bad configs now
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, act)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act) if shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_intermediate_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden] -> same
        weights, ids = route(self.gate(x), self.top_k, self.scoring, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
