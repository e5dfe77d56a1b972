"""`CausalLM`: the base every family derives from, so callers see one typed interface."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from services.engine.attention import AttentionMetadata
from services.engine.models.spec import ModelSpec

# What `checkpoint_to_params` yields: (our parameter name, tensor, shard id or None for a whole tensor)
ParamPiece = tuple[str, torch.Tensor, str | None]


class CausalLM(nn.Module):
    spec: ModelSpec

    def __init__(self, cfg: dict[str, Any], spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec

    @staticmethod
    def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
        """Rename family-specific config keys to the Llama-style ones `build_spec` reads."""
        return cfg

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab_size] float32
        raise NotImplementedError

    def checkpoint_to_params(self, name: str, tensor: torch.Tensor) -> Iterator[ParamPiece]:
        """Checkpoint tensor -> the parameter pieces it fills; yields nothing for unused tensors."""
        yield name, tensor, None
