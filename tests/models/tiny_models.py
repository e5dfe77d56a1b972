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
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    initializer_range=0.25,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)

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
    "mistral-gqa-window": ("mistral", dict(num_key_value_heads=2, intermediate_size=128, sliding_window=8), None),
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
    "mixtral-moe-top2-renormalized": (
        "mixtral",
        dict(num_key_value_heads=2, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2),
        "60KB",
    ),
    "qwen2_moe-shared-expert-dense-layer0": (
        "qwen2_moe",
        dict(
            num_key_value_heads=2,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
            norm_topk_prob=False,
        ),
        None,
    ),
    "qwen3_moe-qknorm-normtopk": (
        "qwen3_moe",
        dict(
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        None,
    ),
    "phi3-fused-partial-rotary": (
        "phi3",
        dict(num_key_value_heads=2, intermediate_size=128, partial_rotary_factor=0.5, tie_word_embeddings=False),
        None,
    ),
    "phi3-longrope": (
        "phi3",
        dict(
            num_key_value_heads=4,
            intermediate_size=96,
            original_max_position_embeddings=64,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5, 7.0],
                long_factor=[2.0, 3.0, 4.0, 6.0, 8.0, 11.0, 14.0, 18.0],
            ),
        ),
        None,
    ),
    "gemma2-window8-softcaps": (
        "gemma2",
        # initializer_range 0.05: Gemma scales embeddings by sqrt(hidden) = 8; at 0.25 greedy repeats 4 tokens
        dict(
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            sliding_window=8,
            query_pre_attn_scalar=24,
            initializer_range=0.05,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=20.0,
        ),
        None,
    ),
    "gemma3-window8-qknorm-local-rope": (
        "gemma3_text",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            sliding_window=8,
            num_hidden_layers=3,
            initializer_range=0.05,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=16,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            },
        ),
        None,
    ),
    "gpt_oss-sinks-window8-yarn-clamped-experts": (
        "gpt_oss",
        # swiglu_limit 1.0: at this init many gate/up values pass it, so the clamps are exercised
        dict(
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            swiglu_limit=1.0,
            initializer_range=0.1,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=64,
            ),
        ),
        None,
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

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
# Gemma's layers have no tensor-parallel sharding yet (their own attention class); gpt-oss refuses TP.
NO_TP_FAMILIES = ("gemma2", "gemma3_text", "gpt_oss")
TP_CASES = [case for case, (family, _, _) in CASES.items() if family not in NO_TP_FAMILIES]


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


def hf_ignores_the_config(model: PreTrainedModel) -> str | None:
    """Why this installed transformers is no oracle for the case, or None. Before 5.18 it hard-codes gpt-oss's
    clamp (limit 7.0) where the config says otherwise, and our case clamps at 1.0 to exercise it."""
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    experts = getattr(getattr(layers[0], "mlp", None), "experts", None) if layers else None
    limit = getattr(model.config, "swiglu_limit", None)
    if experts is not None and limit is not None and getattr(experts, "limit", limit) != limit:
        return f"this transformers ignores config.swiglu_limit {limit} (uses {experts.limit})"
    return None


def hf_greedy(hf: PreTrainedModel, prompt: list[int], num_new: int) -> list[int]:
    """Greedy decoding by full recomputation (no HF cache, no EOS): the plainest oracle for an engine's tokens."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(num_new):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
