"""Phi-3 / Phi-4: the Llama layer with checkpoints that already fuse qkv_proj and gate_up_proj (rows
q|k|v and gate|up, our layout), optionally partially rotary, and LongRoPE scaling.

LongRoPE switches a sequence to its long factors once it passes `original_max_position_embeddings`,
which changes the rotation of every cached position; we implement the short factors only and cap the
context at the original length (logged), where HF uses the short factors as well.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pagedserve.services.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def normalize_config(cfg: dict[str, Any]) -> dict[str, Any]:
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if (params.get("rope_type") or params.get("type")) != "longrope":
            return cfg
        max_position = int(cfg.get("max_position_embeddings") or 4096)
        original = int(
            params.get("original_max_position_embeddings")
            or cfg.get("original_max_position_embeddings")
            or max_position
        )
        if params.get("attention_factor") is None:  # HF's default, from the full (uncapped) length
            factor = float(params.get("factor") or max_position / original)
            params["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        params["original_max_position_embeddings"] = original
        if original < max_position:
            log.warning(
                "longrope: context capped at %d (original_max_position_embeddings); the long factors "
                "are not implemented",
                original,
            )
        key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        return {**cfg, key: params, "max_position_embeddings": min(original, max_position)}
