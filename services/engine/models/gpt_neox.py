"""GPT-NeoX (Pythia): LayerNorm blocks with parallel residuals, partial rotary, fused per-head qkv."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.services.engine.models.base import DecoderLM, ParamPiece, rename
from pagedserve.services.engine.models.fused_qkv import int4_packing, reorder_outputs
from pagedserve.services.engine.models.layers import MLP, Attention, LayerNormBlock
from pagedserve.services.engine.models.rotary import RotaryEmbedding, rope_params_from_config
from pagedserve.services.engine.models.spec import ModelSpec

_NAMES = [
    ("gpt_neox.embed_in.", "model.embed_tokens."),
    ("gpt_neox.final_layer_norm.", "model.norm."),
    ("gpt_neox.layers.", "model.layers."),
    (".attention.query_key_value.", ".self_attn.qkv_proj."),
    (".attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
    ("embed_out.", "lm_head."),  # checkpoints written before transformers 5
]
_UNUSED = ("rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")


def per_head_qkv_to_stacked(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [head, (q|k|v), head_dim] -> [(q|k|v), head, head_dim], the order our qkv_proj splits."""
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(tensor.shape)


class GPTNeoXForCausalLM(DecoderLM):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        rotary = RotaryEmbedding(rope_params_from_config(cfg, spec.head_dim), spec.max_model_len)
        eps, bias = float(cfg.get("layer_norm_eps", 1e-5)), bool(cfg.get("attention_bias", True))
        layers: list[nn.Module] = []
        for _ in range(spec.num_layers):
            attn = Attention(
                spec.hidden_size, spec.num_heads, spec.num_heads, spec.head_dim, rotary, qkv_bias=bias, out_bias=bias
            )
            mlp = MLP(spec.hidden_size, int(cfg["intermediate_size"]), cfg.get("hidden_act", "gelu"))
            is_parallel = bool(cfg.get("use_parallel_residual", True))
            layers.append(LayerNormBlock(attn, mlp, spec.hidden_size, eps, is_parallel, has_mlp_norm=True))
        norm = nn.LayerNorm(spec.hidden_size, eps=eps)
        super().__init__(spec, layers, norm, is_tied=bool(cfg.get("tie_word_embeddings", False)))
        self.int4_packing = int4_packing(cfg)

    @staticmethod
    def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
        cfg = dict(cfg)
        rope = cfg.get("rope_parameters") or {}
        if "partial_rotary_factor" not in rope and "rotary_pct" not in cfg:
            cfg["rotary_pct"] = 0.25  # GPT-NeoX's default when the config leaves it out
        return cfg

    @classmethod
    def from_config(cls, cfg: dict[str, Any], spec: ModelSpec) -> GPTNeoXForCausalLM:
        return cls(cfg, spec)

    def checkpoint_to_params(self, name: str, tensor: torch.Tensor) -> Iterator[ParamPiece]:
        if any(part in name for part in _UNUSED):
            return
        name = rename(name, _NAMES)
        if self.is_tied and name.startswith("lm_head."):
            return
        if ".qkv_proj." in name:  # each tensor along its own output dimension (models/fused_qkv.py)
            param = name.rpartition(".")[2]
            tensor = reorder_outputs(param, tensor, self._qkv_to_stacked, self.int4_packing)
        yield name, tensor, None

    def _qkv_to_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        return per_head_qkv_to_stacked(tensor, self.spec.num_heads)
