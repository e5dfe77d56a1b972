"""Random MoE layers and a per-token oracle written out longhand, shared by the MoE kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.services.engine.models.moe import route

SWIGLU = dict(swiglu_alpha=1.702, swiglu_limit=7.0)  # gpt-oss's values


@dataclass
class MoeCase:
    x: torch.Tensor  # [num_tokens, hidden]
    w13: torch.Tensor  # [E, 2I, hidden]
    w2: torch.Tensor  # [E, hidden, I]
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    kwargs: dict  # activation, biases, swiglu constants

    def in_fp32(self) -> MoeCase:
        kwargs = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in self.kwargs.items()}
        return MoeCase(self.x.float(), self.w13.float(), self.w2.float(), self.topk_weights, self.topk_ids, kwargs)


def random_case(
    num_tokens: int,
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    swiglu: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> MoeCase:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    x = rand(num_tokens, hidden)
    w13 = rand(num_experts, 2 * intermediate, hidden, scale=hidden**-0.5)
    w2 = rand(num_experts, hidden, intermediate, scale=intermediate**-0.5)
    topk_weights, topk_ids = route(torch.randn(num_tokens, num_experts, generator=gen), top_k, scoring, renormalize)
    kwargs: dict = {}
    if swiglu:  # gpt-oss: biases on both GEMMs; 3x weights so some gate/up values pass the clamp
        kwargs = dict(
            activation="swigluoai",
            w13_bias=rand(num_experts, 2 * intermediate),
            w2_bias=rand(num_experts, hidden),
            **SWIGLU,
        )
        w13 = w13 * 3
    return MoeCase(x, w13, w2, topk_weights, topk_ids, kwargs)


def per_token_oracle(case: MoeCase) -> torch.Tensor:
    """out[t] = sum_s weight[t, s] * W2[e] act(W13[e] x[t] + b13[e]) + b2[e], in fp32, one token at a time."""
    c = case.in_fp32()
    kw = c.kwargs
    out = torch.zeros_like(c.x)
    for t in range(c.x.shape[0]):
        for s in range(c.topk_ids.shape[1]):
            e = int(c.topk_ids[t, s])
            gate_up = c.w13[e] @ c.x[t]
            if "w13_bias" in kw:
                gate_up = gate_up + kw["w13_bias"][e]
            gate, up = gate_up.chunk(2)
            if kw.get("activation") == "swigluoai":
                gate, up = gate.clamp(max=kw["swiglu_limit"]), up.clamp(-kw["swiglu_limit"], kw["swiglu_limit"])
                hidden = (up + 1) * gate * torch.sigmoid(kw["swiglu_alpha"] * gate)
            else:
                hidden = gate * torch.sigmoid(gate) * up
            y = c.w2[e] @ hidden
            if "w2_bias" in kw:
                y = y + kw["w2_bias"][e]
            out[t] += c.topk_weights[t, s] * y
    return out
