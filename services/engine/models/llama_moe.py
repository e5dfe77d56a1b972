"""Mixture-of-experts Llama relatives: Mixtral, Qwen2-MoE (shared expert, qkv bias), Qwen3-MoE (q/k norm).

The decoder layer is Llama's with `mlp` a `moe.MoE` on the sparse layers. Qwen layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` stride, keep a dense GatedMLP.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from pagedserve.services.engine.models.base import ParamPiece
from pagedserve.services.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedserve.services.engine.models.moe import MoE
from pagedserve.services.engine.models.quantized_experts import experts_class
from pagedserve.services.engine.models.spec import ModelSpec, first_key

# Per-expert checkpoint names -> (our 3-D parameter, part); Mixtral's w1/w3/w2 are gate/up/down.
_EXPERT_PARTS = {
    "gate_proj": ("gate_up_proj", "gate"),
    "w1": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "w3": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
    "w2": ("down_proj", "down"),
}
# weight, and quantized experts' weight_scale / weight_zeros (models/quantized_experts.py)
_PER_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.weight(_scale|_zeros)?$")
_FUSED_EXPERTS = tuple(f".experts.{w}{suffix}" for w in ("gate_up_proj", "down_proj") for suffix in ("", "_scale"))


def is_sparse_layer(cfg: dict[str, Any], layer_idx: int) -> bool:
    """HF's rule (Qwen2/3-MoE): experts unless listed in mlp_only_layers or off the sparse step."""
    step = int(cfg.get("decoder_sparse_step") or 1)
    return layer_idx not in (cfg.get("mlp_only_layers") or []) and (layer_idx + 1) % step == 0


def build_moe(cfg: dict[str, Any], spec: ModelSpec) -> MoE:
    is_mixtral = cfg.get("model_type") == "mixtral"
    return MoE(
        spec.hidden_size,
        int(cfg["intermediate_size"] if is_mixtral else cfg["moe_intermediate_size"]),
        int(first_key(cfg, "num_local_experts", "num_experts")),
        int(cfg["num_experts_per_tok"]),
        cfg.get("hidden_act", "silu"),
        renormalize=True if is_mixtral else bool(cfg.get("norm_topk_prob", False)),
        scoring=str(cfg.get("scoring_func") or "softmax"),
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        experts_class=experts_class(cfg),
    )


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        for idx, layer in enumerate(self.model.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            if is_sparse_layer(cfg, idx):
                layer.mlp = build_moe(cfg, spec)  # type: ignore[assignment]

    @classmethod
    def from_config(cls, cfg: dict[str, Any], spec: ModelSpec) -> MoeForCausalLM:
        return cls(cfg, spec)

    def checkpoint_to_params(self, name: str, tensor: torch.Tensor) -> Iterator[ParamPiece]:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's Hub name for the MoE block
        if match := _PER_EXPERT.match(name):
            prefix, expert, proj, suffix = match.groups()
            if proj in _EXPERT_PARTS:
                ours, part = _EXPERT_PARTS[proj]
                yield f"{prefix}.experts.{ours}{suffix or ''}", tensor, f"{part}:{expert}"
                return
        if name.endswith(_FUSED_EXPERTS):  # fused 3-D: ours already
            yield name, tensor, None
            return
        yield from super().checkpoint_to_params(name, tensor)
