"""The Llama decoder and its close relatives: Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

x = embed(ids)
per layer:  x = x + attn(rmsnorm(x));  x = x + mlp(rmsnorm(x))
logits = lm_head(rmsnorm(x))      (lm_head = embed when embeddings are tied)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.attention import AttentionMetadata
from services.engine.models.base import CausalLM, ParamPiece
from services.engine.models.layers import Attention, GatedMLP, RMSNorm
from services.engine.models.rotary import RotaryEmbedding, rope_params_from_config
from services.engine.models.spec import ModelSpec

# checkpoint projection name -> (our fused projection, shard id)
_PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        is_qwen3 = cfg.get("model_type") == "qwen3"
        self.self_attn = Attention(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            rotary,
            qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            out_bias=bool(cfg.get("attention_bias", False)) and cfg.get("model_type") != "qwen2",
            qk_norm_eps=eps if is_qwen3 else None,
        )
        self.mlp = GatedMLP(
            spec.hidden_size,
            int(cfg["intermediate_size"]),
            cfg.get("hidden_act", "silu"),
            bias=bool(cfg.get("mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # x: [num_tokens, hidden_size]
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        super().__init__()
        rope = rope_params_from_config(cfg, spec.head_dim)
        rotary = RotaryEmbedding(rope, spec.max_model_len)  # one cos/sin cache shared by all layers
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, spec, rotary) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, float(cfg.get("rms_norm_eps", 1e-6)))


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        super().__init__(cfg, spec)
        self.model = LlamaModel(cfg, spec)
        self.is_tied = bool(cfg.get("tie_word_embeddings", False))
        # Tied: compute_logits reads embed_tokens.weight, so no second parameter can drift apart.
        self.lm_head = None if self.is_tied else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(positions, x, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab_size] float32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def checkpoint_to_params(self, name: str, tensor: torch.Tensor) -> Iterator[ParamPiece]:
        if "rotary_emb.inv_freq" in name or (self.is_tied and name.startswith("lm_head.")):
            return
        for hf_name, (ours, shard_id) in _PACKED.items():
            if f".{hf_name}." in name:
                yield name.replace(f".{hf_name}.", f".{ours}."), tensor, shard_id
                return
        yield name, tensor, None
