"""The Llama decoder and its close relatives: Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

Per layer: x = x + attn(rmsnorm(x)); x = x + mlp(rmsnorm(x)) -- checkpoint names are ours already,
except that q/k/v and gate/up are fused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.models import fused_ops
from pagedserve.services.engine.models.base import DecoderLM, ParamPiece
from pagedserve.services.engine.models.layers import Attention, GatedMLP, RMSNorm
from pagedserve.services.engine.models.rotary import RotaryEmbedding, rope_params_from_config
from pagedserve.services.engine.models.spec import ModelSpec

# checkpoint projection name -> (our fused projection, shard id)
PACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _attention_biases(cfg: dict[str, Any]) -> tuple[bool, bool]:
    """(q/k/v bias, output bias): Qwen2 hard-codes biases on q/k/v only; the others read attention_bias."""
    if cfg.get("model_type") in ("qwen2", "qwen2_moe"):
        return bool(cfg.get("qkv_bias", True)), False
    has_bias = bool(cfg.get("attention_bias", False))
    return has_bias, has_bias


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], spec: ModelSpec, rotary: RotaryEmbedding, window: int | None = None
    ) -> None:
        super().__init__()
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        qkv_bias, out_bias = _attention_biases(cfg)
        self.self_attn = Attention(
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            rotary,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            qk_norm_eps=eps if cfg.get("model_type") in ("qwen3", "qwen3_moe") else None,
            window=window,
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

    def forward_residual(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,  # [num_tokens, hidden_size]: the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]: the stream before x is added; None first
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        partial_out: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream): each add fused into a norm
        """Under tensor parallelism the attention output, and the MLP output where `partial_out`, may be
        this rank's unreduced addend: the add_rms_norm that follows sums it over the ranks."""
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        h, residual = fused_ops.add_rms_norm(x, residual, norm_in.weight, norm_in.eps)
        h = self.self_attn(positions, h, kv_cache, meta, partial=True)
        h, residual = fused_ops.add_rms_norm(h, residual, norm_post.weight, norm_post.eps)
        if isinstance(self.mlp, GatedMLP):
            return self.mlp(h, partial=partial_out), residual
        return self.mlp(h), residual


class LlamaForCausalLM(DecoderLM):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        rotary = RotaryEmbedding(rope_params_from_config(cfg, spec.head_dim), spec.max_model_len)
        layers: list[nn.Module] = [
            LlamaDecoderLayer(cfg, spec, rotary, spec.window_of(i)) for i in range(spec.num_layers)
        ]
        norm = RMSNorm(spec.hidden_size, float(cfg.get("rms_norm_eps", 1e-6)))
        super().__init__(spec, layers, norm, is_tied=bool(cfg.get("tie_word_embeddings", False)))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if not fused_ops.is_fused(self.model.embed_tokens.weight):
            return super().forward(input_ids, positions, kv_caches, meta)
        x = self.model.embed_tokens(input_ids)
        # Fused path: the residual travels beside x, so every add is part of the next norm's kernel.
        residual: torch.Tensor | None = None
        aux_layers, self.aux_hidden_states = self.aux_hidden_layers, []
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            assert isinstance(layer, LlamaDecoderLayer)
            if i in aux_layers:  # the stream entering layer i; a copy, as the fused norms update theirs in place
                self.aux_hidden_states.append(x.clone() if residual is None else x + residual)
            # the stream an aux layer copies must be whole: the MLP before it reduces its own output
            partial_out = i + 1 not in aux_layers
            x, residual = layer.forward_residual(positions, x, residual, kv_cache, meta.for_layer(i), partial_out)
        norm = self.model.norm
        assert isinstance(norm, RMSNorm)
        out, _ = fused_ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        return out

    @classmethod
    def from_config(cls, cfg: dict[str, Any], spec: ModelSpec) -> LlamaForCausalLM:
        return cls(cfg, spec)

    def checkpoint_to_params(self, name: str, tensor: torch.Tensor) -> Iterator[ParamPiece]:
        if "rotary_emb.inv_freq" in name or (self.is_tied and name.startswith("lm_head.")):
            return
        if not name.startswith(("model.", "lm_head.")):  # a bare decoder (`Qwen3Model`: embedding checkpoints)
            name = f"model.{name}"
        for hf_name, (ours, shard_id) in PACKED_PROJECTIONS.items():
            if f".{hf_name}." in name:
                yield name.replace(f".{hf_name}.", f".{ours}."), tensor, shard_id
                return
        yield name, tensor, None
