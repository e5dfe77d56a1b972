"""Gemma 2 and Gemma 3 (text): Llama-like attention with Gemma's quirks.

    x = embed * sqrt(hidden)
    per layer: x = x + post_attn_norm(attn(input_norm(x)));  x = x + post_ff_norm(mlp(pre_ff_norm(x)))
    norms scale by (1 + weight); the MLP is GeGLU (gelu tanh); scores scale by query_pre_attn_scalar^-0.5
    Gemma 2: attention-logit and final-logit soft-capping.  Gemma 3: q/k norms, a rope theta per layer type.
    Local ("sliding_attention") and global layers interleave: `layer_types`, else the older patterns.

Windows and attention-logit soft-capping (Gemma 2) run in both attention backends (on Triton, in the paged
kernel). Gemma3ForConditionalGeneration's vision tower is refused at start.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.services.engine import attention
from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.models.base import DecoderLM, ParamPiece
from pagedserve.services.engine.models.layers import DenseLinear, GatedMLP, ShardedLinear
from pagedserve.services.engine.models.llama import PACKED_PROJECTIONS
from pagedserve.services.engine.models.rotary import RotaryEmbedding, rope_params_from_config
from pagedserve.services.engine.models.spec import ModelSpec

SLIDING = "sliding_attention"


class GemmaRMSNorm(nn.Module):
    """HF's GemmaRMSNorm: all in fp32, scaled by (1 + weight), then cast back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


def layer_types(cfg: dict[str, Any]) -> list[str]:
    num_layers = int(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if cfg.get("model_type") == "gemma2":  # Gemma 2: local, global, local, ...
        return [SLIDING if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    pattern = int(cfg.get("sliding_window_pattern") or 6)  # Gemma 3: every pattern-th layer global
    return [SLIDING if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def rotary_for(cfg: dict[str, Any], layer_type: str, spec: ModelSpec) -> RotaryEmbedding:
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):  # transformers 5 Gemma 3: one rope per layer type
        rope_cfg = {"rope_parameters": params[layer_type]}
    elif layer_type == SLIDING and cfg.get("rope_local_base_freq"):  # older Gemma 3 configs
        rope_cfg = {"rope_theta": cfg["rope_local_base_freq"]}
    else:
        rope_cfg = cfg
    return RotaryEmbedding(rope_params_from_config(rope_cfg, spec.head_dim), spec.max_model_len)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(cfg.get("attention_bias", False))
        self.qkv_proj = ShardedLinear(spec.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}, bias)
        self.o_proj = DenseLinear(self.q_size, spec.hidden_size, bias=bias)
        self.rotary, self.window = rotary, window
        self.scale = float(cfg.get("query_pre_attn_scalar") or spec.head_dim) ** -0.5
        self.softcap = cfg.get("attn_logit_softcapping")
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        is_gemma3 = cfg.get("model_type") != "gemma2"
        self.q_norm = GemmaRMSNorm(self.head_dim, eps) if is_gemma3 else None
        self.k_norm = GemmaRMSNorm(self.head_dim, eps) if is_gemma3 else None

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = attention.paged_attention(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(out.reshape(n, self.q_size))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], spec: ModelSpec, rotary: RotaryEmbedding, window: int | None) -> None:
        super().__init__()
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.self_attn = GemmaAttention(cfg, spec, rotary, window)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        self.mlp = GatedMLP(spec.hidden_size, int(cfg["intermediate_size"]), act)
        self.input_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(DecoderLM):
    supports_tensor_parallel = False  # GemmaAttention is not the shared Attention that sharding rewrites
    supports_aux_hidden_states = False  # its own forward keeps none (EAGLE-3 heads are for Llama-like targets)

    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        types = layer_types(cfg)
        rotaries = {t: rotary_for(cfg, t, spec) for t in sorted(set(types))}
        layers: list[nn.Module] = [
            GemmaDecoderLayer(cfg, spec, rotaries[t], spec.layer_windows[i] if spec.layer_windows else None)
            for i, t in enumerate(types)
        ]
        norm = GemmaRMSNorm(spec.hidden_size, float(cfg.get("rms_norm_eps", 1e-6)))
        super().__init__(spec, layers, norm, is_tied=bool(cfg.get("tie_word_embeddings", True)))
        self.final_softcap = cfg.get("final_logit_softcapping")

    @staticmethod
    def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
        if "vision_config" in cfg:
            raise ValueError(
                f"{cfg['architectures'][0]}: the vision tower is not supported; serve the text model "
                "(Gemma3ForCausalLM)"
            )
        window = cfg.get("sliding_window")
        windows = [int(window) if t == SLIDING and window else None for t in layer_types(cfg)]
        return {**cfg, "layer_windows": windows}

    @classmethod
    def from_config(cls, cfg: dict[str, Any], spec: ModelSpec) -> GemmaForCausalLM:
        return cls(cfg, spec)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype)  # rounded to the dtype, as HF does
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x = layer(positions, x, kv_cache, meta.for_layer(i))
        out: torch.Tensor = self.model.norm(x)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        cap = float(self.final_softcap)
        return torch.tanh(logits / cap) * cap

    def checkpoint_to_params(self, name: str, tensor: torch.Tensor) -> Iterator[ParamPiece]:
        if self.is_tied and name.startswith("lm_head."):
            return
        for hf_name, (ours, shard_id) in PACKED_PROJECTIONS.items():
            if f".{hf_name}." in name:
                yield name.replace(f".{hf_name}.", f".{ours}."), tensor, shard_id
                return
        yield name, tensor, None
