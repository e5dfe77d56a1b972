"""`CausalLM`, the typed interface callers see, and `DecoderLM`, the stack every family builds.

    DecoderLM.model.embed_tokens -> model.layers[i](positions, x, kv_caches[i], meta.for_layer(i)) -> model.norm
    compute_logits: lm_head, or embed_tokens.weight when embeddings are tied

Families differ only in their layers, their config keys and their checkpoint names, which they
translate to ours in `checkpoint_to_params` (see `rename`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.models.spec import ModelSpec

# What `checkpoint_to_params` yields: (our parameter name, tensor, shard id or None for a whole tensor)
ParamPiece = tuple[str, torch.Tensor, str | None]


class CausalLM(nn.Module):
    spec: ModelSpec
    # Attention features only the torch backend has (e.g. "sliding-window attention"): the worker refuses
    # other backends at start.
    needs_torch_attention: str | None = None
    # False for families whose layers parallel/sharding.py does not know (it would leave them whole).
    supports_tensor_parallel = True
    loads_mxfp4 = False  # MXFP4 tensors (`*_blocks`/`*_scales`) are read by families that say so
    # EAGLE-3 (spec_decode/eagle3.py) reads the residual stream entering these layers; the forward leaves them,
    # ascending by layer, in `aux_hidden_states` ([num_tokens, hidden_size] each). Empty: nothing is kept.
    supports_aux_hidden_states = False  # families whose forward fills them
    aux_hidden_layers: frozenset[int] = frozenset()
    aux_hidden_states: list[torch.Tensor]

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec

    @staticmethod
    def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
        """Rename family-specific config keys to the Llama-style ones `build_spec` reads."""
        return cfg

    @classmethod
    def from_config(cls, cfg: dict[str, Any], spec: ModelSpec) -> CausalLM:
        """Build the (unloaded) module; families take `(cfg, spec)` in their constructor."""
        raise NotImplementedError

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


class DecoderStack(nn.Module):
    def __init__(self, spec: ModelSpec, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class DecoderLM(CausalLM):
    supports_aux_hidden_states = True
    # Tensor parallelism (parallel/sharding.py): joins the ranks' vocabulary slices of the logits.
    logits_gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, spec: ModelSpec, layers: list[nn.Module], norm: nn.Module, is_tied: bool) -> None:
        super().__init__(spec)
        self.model = DecoderStack(spec, layers, norm)
        self.is_tied = is_tied
        # Tied: compute_logits reads embed_tokens.weight, so no second parameter can drift apart.
        self.lm_head = None if is_tied else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        aux_layers, self.aux_hidden_states = self.aux_hidden_layers, []
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            if i in aux_layers:
                self.aux_hidden_states.append(x)
            x = layer(positions, x, kv_cache, meta.for_layer(i))
        out: torch.Tensor = self.model.norm(x)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight).float()
        return logits if self.logits_gather is None else self.logits_gather(logits)


def rename(name: str, pairs: list[tuple[str, str]]) -> str:
    """Apply every (checkpoint fragment -> our fragment) substitution that matches."""
    for old, new in pairs:
        if old in name:
            name = name.replace(old, new)
    return name
