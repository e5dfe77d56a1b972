"""Model families, each a compact nn.Module that calls `pagedserve.services.engine.attention.paged_attention`.

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

Families (one shared `DecoderLM` stack, layers from `layers.py`, rotary from `rotary.py`):
    llama.py     LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (qkv bias), Qwen3ForCausalLM
                 (q/k RMSNorm); GQA/MQA, tied embeddings, rope default/linear/dynamic/llama3
    gpt_neox.py  GPTNeoXForCausalLM: LayerNorm, parallel or sequential residual, partial rotary
    falcon.py    FalconForCausalLM / RWForCausalLM: multi-query, new decoder architecture (grouped kv,
                 one or two norms), per-head qkv; rotary only (ALiBi Falcon is refused)
    gpt_oss.py   GptOssForCausalLM: attention sinks, alternating sliding-window/global layers, YaRN,
                 biased router (softmax over the top-k logits), clamped SwiGLU experts with biases
Anything else raises UnsupportedArchitectureError naming these. Loading (`loader.py`, `weights.py`):
config.json, single or sharded safetensors (index file) streamed tensor by tensor into parameters
of a module built on the meta device, a tqdm bar, dtype "auto" = fp32 on CPU, the config's dtype
on CUDA (bf16 when it says fp32). Sliding windows (Mistral v0.1, Qwen2, Phi-3, Gemma, gpt-oss) are per layer
in `spec.layer_windows` and run in the attention backends (torch path and Triton paged kernel).
`load_model(..., parallel=ctx)` builds and loads one tensor-parallel rank's shard, and
`random_weights_seed=N` fills random weights identical for every tensor-parallel size (see
services/engine/parallel). `python -m pagedserve.services.engine.models [MODEL]` prints the spec and the
resolve/load times.
"""

from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.models.loader import (
    ARCHITECTURES,
    UnsupportedArchitectureError,
    load_model,
    resolve_dtype,
)
from pagedserve.services.engine.models.spec import ModelSpec

__all__ = ["ARCHITECTURES", "CausalLM", "ModelSpec", "UnsupportedArchitectureError", "load_model", "resolve_dtype"]
