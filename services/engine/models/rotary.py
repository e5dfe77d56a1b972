"""Rotary position embeddings: the variants HF checkpoints use, read from either config style.

transformers 5 writes `rope_parameters = {"rope_type", "rope_theta", "factor", ...}`; older configs
write `rope_theta` (or NeoX's `rotary_emb_base`) plus an optional `rope_scaling` dict. Both are
normalised by `rope_params_from_config`. Supported types: default, linear, llama3, dynamic,
longrope (Phi-3: its short factors only; the family caps the context at the original length, where
HF uses the short factors too, and the attention factor scales cos/sin) and yarn (gpt-oss: frequencies
blended between interpolated and original by a ramp over the dims, cos/sin scaled by its mscale).

`dynamic` (NTK) only changes frequencies once a sequence outgrows `max_position_embeddings`, and
the loader never allows a longer `max_model_len`, so inside our range it equals `default` -- which is
exactly what HF computes for such lengths.

Rotation is the NeoX "rotate half" form over the first `rotary_dim` dims of each head (all dims
unless the model is partially rotary, e.g. GPT-NeoX's `rotary_pct`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")


@dataclass(slots=True)
class RopeParams:
    rope_type: str
    theta: float
    rotary_dim: int  # leading dims of each head that rotate; the rest pass through
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors
    attention_factor: float = 1.0  # longrope, yarn: cos/sin scale
    beta_fast: float = 32.0  # yarn: rotations where the ramp from original to interpolated starts ...
    beta_slow: float = 1.0  # ... and ends
    truncate: bool = True  # yarn: round the ramp's ends to whole dims (gpt-oss: False)


def rope_params_from_config(cfg: dict[str, Any], head_dim: int, default_theta: float = 10000.0) -> RopeParams:
    params: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta") or cfg.get("rope_theta") or cfg.get("rotary_emb_base") or default_theta
    partial = params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or cfg.get("rotary_pct")
    rotary_dim = int(head_dim * float(partial)) if partial else head_dim
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return RopeParams(
        rope_type=rope_type,
        theta=float(theta),
        rotary_dim=rotary_dim,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(
            params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 8192)
        ),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        attention_factor=float(params.get("attention_factor") or _default_attention_factor(rope_type, params, cfg)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
    )


def _default_attention_factor(rope_type: str, params: dict[str, Any], cfg: dict[str, Any]) -> float:
    """YaRN's cos/sin scale when the config names none: 0.1 * ln(factor) + 1 (HF's get_mscale)."""
    if rope_type != "yarn":
        return 1.0
    original = params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 8192)
    factor = float(params.get("factor") or cfg.get("max_position_embeddings", original) / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):  # DeepSeek's variant
        return mscale(factor, float(params["mscale"])) / mscale(factor, float(params["mscale_all_dim"]))
    return mscale(factor)


def _yarn_inverse_frequencies(p: RopeParams, pos_freqs: torch.Tensor) -> torch.Tensor:
    """Per dim pair: the original frequency where it turns more than beta_fast times over the original
    context, the interpolated one (/ factor) below beta_slow turns, a linear blend in between."""

    def correction_dim(num_rotations: float) -> float:
        turns = p.original_max_position / (num_rotations * 2 * math.pi)
        return p.rotary_dim * math.log(turns) / (2 * math.log(p.theta))

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, p.rotary_dim - 1)
    if low == high:
        high += 0.001  # as HF: avoids a division by zero
    ramp = ((torch.arange(p.rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    return (1.0 / (p.factor * pos_freqs)) * (1 - keep_original) + (1.0 / pos_freqs) * keep_original


def inverse_frequencies(p: RopeParams) -> torch.Tensor:  # [rotary_dim // 2] float32
    # Same arithmetic as transformers so fp32 results agree bit for bit.
    exponents = torch.arange(0, p.rotary_dim, 2, dtype=torch.int64).to(torch.float) / p.rotary_dim
    inv_freq = 1.0 / (p.theta**exponents)
    if p.rope_type == "longrope":
        inv_freq = 1.0 / (torch.tensor(p.short_factor, dtype=torch.float32) * p.theta**exponents)
    elif p.rope_type == "yarn":
        inv_freq = _yarn_inverse_frequencies(p, p.theta**exponents)
    elif p.rope_type == "linear":
        inv_freq = inv_freq / p.factor
    elif p.rope_type == "llama3":
        low_wavelen = p.original_max_position / p.low_freq_factor
        high_wavelen = p.original_max_position / p.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / p.factor, inv_freq)
        smooth = (p.original_max_position / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor)
        smoothed = (1 - smooth) * scaled / p.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings in place of nothing: returns rotated copies of q and k."""

    def __init__(self, params: RopeParams, max_position: int) -> None:
        super().__init__()
        self.params = params
        self.rotary_dim = params.rotary_dim
        self.max_position = max_position
        # Built on the real device after loading (modules are created on the meta device).
        self.cos_cache: torch.Tensor | None = None  # [max_position, rotary_dim] float32
        self.sin_cache: torch.Tensor | None = None

    def build_cache(self, device: torch.device) -> None:
        positions = torch.arange(self.max_position, dtype=torch.float, device=device)
        freqs = positions[:, None] * inverse_frequencies(self.params).to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
        scale = self.params.attention_factor
        self.cos_cache, self.sin_cache = emb.cos() * scale, emb.sin() * scale

    def caches_for(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables [max_position, rotary_dim] on query's device in query's dtype."""
        if self.cos_cache is None or self.cos_cache.device != query.device:
            self.build_cache(query.device)
        assert self.cos_cache is not None and self.sin_cache is not None
        if self.cos_cache.dtype != query.dtype:  # cast once (the same values as casting each gather)
            self.cos_cache, self.sin_cache = self.cos_cache.to(query.dtype), self.sin_cache.to(query.dtype)
        return self.cos_cache, self.sin_cache

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_cache, sin_cache = self.caches_for(query)
        cos = cos_cache[positions][:, None, :]  # [num_tokens, 1, rotary_dim]
        sin = sin_cache[positions][:, None, :]
        return _rotate(query, cos, sin, self.rotary_dim), _rotate(key, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos + rotated * sin
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)
