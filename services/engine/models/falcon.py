"""Falcon: multi-query (7B style), grouped "new decoder architecture" (40B/180B style), or per-head.

Its fused query_key_value rows come in three layouts; `falcon_qkv_to_stacked` reorders each into
ours, [q heads | k heads | v heads]:

    new_decoder_architecture: [kv_group][q_0 .. q_{g-1}, k, v][head_dim]
    multi_query:              [q_0 .. q_{h-1}, k, v][head_dim]           (already ours)
    neither:                  [head][q, k, v][head_dim]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.services.engine.models.base import DecoderLM, ParamPiece, rename
from pagedserve.services.engine.models.fused_qkv import int4_packing, reorder_outputs
from pagedserve.services.engine.models.gpt_neox import per_head_qkv_to_stacked
from pagedserve.services.engine.models.layers import MLP, Attention, LayerNormBlock
from pagedserve.services.engine.models.rotary import RotaryEmbedding, rope_params_from_config
from pagedserve.services.engine.models.spec import ModelSpec

_NAMES = [
    ("transformer.word_embeddings.", "model.embed_tokens."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."),
    (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
    (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
    (".ln_attn.", ".input_layernorm."),
    (".ln_mlp.", ".post_attention_layernorm."),
]


def falcon_qkv_to_stacked(tensor: torch.Tensor, cfg: dict[str, Any], spec: ModelSpec) -> torch.Tensor:
    rest = tensor.shape[1:]
    if cfg.get("new_decoder_architecture"):
        group = spec.num_heads // spec.num_kv_heads
        rows = tensor.reshape(spec.num_kv_heads, group + 2, spec.head_dim, *rest)
        q, k, v = rows[:, :group], rows[:, group], rows[:, group + 1]
        return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)])
    if cfg.get("multi_query", True):
        return tensor
    return per_head_qkv_to_stacked(tensor, spec.num_heads)


class FalconForCausalLM(DecoderLM):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        rotary = RotaryEmbedding(rope_params_from_config(cfg, spec.head_dim), spec.max_model_len)
        eps, bias = float(cfg.get("layer_norm_epsilon", 1e-5)), bool(cfg.get("bias", False))
        is_new = bool(cfg.get("new_decoder_architecture", False))
        is_parallel = is_new or bool(cfg.get("parallel_attn", True))
        # Two norms unless a parallel block shares one (old arch, or new arch with num_ln_in_parallel_attn=1).
        has_mlp_norm = not is_parallel or (is_new and cfg.get("num_ln_in_parallel_attn") in (None, 2))
        ffn_size = int(cfg.get("ffn_hidden_size") or 4 * spec.hidden_size)
        layers: list[nn.Module] = []
        for _ in range(spec.num_layers):
            attn = Attention(
                spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, rotary, qkv_bias=bias, out_bias=bias
            )
            mlp = MLP(spec.hidden_size, ffn_size, cfg.get("activation", "gelu"), bias=bias)
            layers.append(LayerNormBlock(attn, mlp, spec.hidden_size, eps, is_parallel, has_mlp_norm))
        norm = nn.LayerNorm(spec.hidden_size, eps=eps)
        super().__init__(spec, layers, norm, is_tied=bool(cfg.get("tie_word_embeddings", True)))
        self.cfg = cfg
        self.int4_packing = int4_packing(cfg)

    @staticmethod
    def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
        if cfg.get("alibi"):
            raise ValueError("Falcon with ALiBi positions (falcon-rw) is not supported: only rotary Falcon models")
        cfg = dict(cfg)
        num_heads = cfg.get("num_attention_heads") or cfg.get("n_head")
        cfg["num_attention_heads"] = num_heads
        cfg["num_hidden_layers"] = cfg.get("num_hidden_layers") or cfg.get("n_layer")
        cfg["hidden_size"] = cfg.get("hidden_size") or cfg.get("n_embed")
        if cfg.get("new_decoder_architecture"):
            cfg["num_key_value_heads"] = cfg.get("num_kv_heads") or cfg.get("n_head_kv") or num_heads
        elif cfg.get("multi_query", True):
            cfg["num_key_value_heads"] = 1
        else:
            cfg["num_key_value_heads"] = num_heads
        cfg.pop("head_dim", None)  # always hidden_size // heads for Falcon
        return cfg

    @classmethod
    def from_config(cls, cfg: dict[str, Any], spec: ModelSpec) -> FalconForCausalLM:
        return cls(cfg, spec)

    def checkpoint_to_params(self, name: str, tensor: torch.Tensor) -> Iterator[ParamPiece]:
        if "rotary_emb.inv_freq" in name:
            return
        name = rename(name, _NAMES)
        if self.is_tied and name.startswith("lm_head."):
            return
        if ".qkv_proj." in name:  # each tensor along its own output dimension (models/fused_qkv.py)
            param = name.rpartition(".")[2]
            tensor = reorder_outputs(param, tensor, self._qkv_to_stacked, self.int4_packing)
        yield name, tensor, None

    def _qkv_to_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        return falcon_qkv_to_stacked(tensor, self.cfg, self.spec)
