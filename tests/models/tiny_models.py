"""Tiny random-weight checkpoints of every supported family, written with HF `save_pretrained`.

Each case covers the quirks its family is known for; weights use a wide init so greedy argmaxes are
far from ties (at the default 0.02 std every logit is ~0 and any rounding flips the argmax).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

_COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
    initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip

_LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=32,
)  # fmt: skip

# case id -> (model_type, config overrides, max_shard_size for save_pretrained or None)
CASES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "llama-gqa-tied-llama3rope-sharded": (
        "llama",
        dict(num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True, rope_parameters=_LLAMA3_ROPE),
        "40KB",
    ),
    "llama-mqa-bias-linearrope": (
        "llama",
        dict(
            num_key_value_heads=1,
            intermediate_size=96,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0),
            tie_word_embeddings=False,
        ),
        None,
    ),
    "mistral-gqa-window": ("mistral", dict(num_key_value_heads=2, intermediate_size=128, sliding_window=64), None),
    "qwen2-qkv-bias-tied": (
        "qwen2",
        dict(num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True),
        None,
    ),
    "qwen3-qknorm-headdim": (
        "qwen3",
        dict(num_key_value_heads=2, head_dim=32, intermediate_size=128, tie_word_embeddings=False),
        "60KB",
    ),
    "gpt_neox-parallel-partial-rotary": (
        "gpt_neox",
        dict(intermediate_size=128, use_parallel_residual=True, rotary_pct=0.25, tie_word_embeddings=False),
        None,
    ),
    "gpt_neox-sequential-half-rotary": (
        "gpt_neox",
        dict(intermediate_size=128, use_parallel_residual=False, rotary_pct=0.5, attention_bias=False),
        None,
    ),
    "falcon-multi-query-parallel": (
        "falcon",
        dict(multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False),
        None,
    ),
    "falcon-new-decoder-gqa": (
        "falcon",
        dict(new_decoder_architecture=True, num_kv_heads=2, bias=False, tie_word_embeddings=False),
        "40KB",
    ),
    "falcon2-new-decoder-one-norm": (
        "falcon",
        dict(new_decoder_architecture=True, num_kv_heads=1, num_ln_in_parallel_attn=1, tie_word_embeddings=False),
        None,
    ),
    "falcon-per-head-sequential-bias": (
        "falcon",
        dict(multi_query=False, new_decoder_architecture=False, parallel_attn=False, bias=True),
        None,
    ),
}


def build_tiny_model(case: str, out_dir: Path) -> PreTrainedModel:
    """Save the case's random model in `out_dir` and return the HF model (fp32, eager attention)."""
    model_type, overrides, max_shard_size = CASES[case]
    config = AutoConfig.for_model(model_type, **{**_COMMON, **overrides})
    config._attn_implementation = "eager"  # plain matmul-softmax-matmul: the reference math
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model
