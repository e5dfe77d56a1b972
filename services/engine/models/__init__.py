"""Model families, each a compact nn.Module that calls `services.engine.attention.paged_attention`.

The interface every family implements (the runner relies on nothing else):

    model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
        # dtype may also be "auto" | "bf16" | "fp16" | "fp32"; keyword max_model_len is checked
        # against the config (ValueError when longer)
    hidden = model(input_ids, positions, kv_caches, meta)
        # input_ids  [num_tokens] int64, positions [num_tokens] int64 (absolute positions),
        # kv_caches  list (one per layer) of [2, num_blocks, block_size, num_kv_heads, head_dim],
        # meta       AttentionMetadata for the step; hidden [num_tokens, hidden_size]
    logits = model.compute_logits(hidden)  # [n, vocab_size] float32
    model.spec  -> ModelSpec (architecture, num_layers, num_heads, num_kv_heads, head_dim,
                   hidden_size, vocab_size, max_position_embeddings (alias max_position),
                   max_model_len, dtype, eos_token_ids, bos_token_id, generation_defaults;
                   kv_bytes_per_token())
"""

from services.engine.models.base import CausalLM
from services.engine.models.loader import (
    ARCHITECTURES,
    UnsupportedArchitectureError,
    load_model,
    resolve_dtype,
)
from services.engine.models.spec import ModelSpec

__all__ = ["ARCHITECTURES", "CausalLM", "ModelSpec", "UnsupportedArchitectureError", "load_model", "resolve_dtype"]
