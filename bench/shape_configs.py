"""config.json of the issue-20/21 model shapes (text models, bf16), and the same shapes scaled down for CPU runs.

The attention fields of Gemma 3 and gpt-oss are bench/kv_capacity.py's (one home); the rest is as published on
the Hub (Qwen/Qwen3-30B-A3B, openai/gpt-oss-20b without its MXFP4 quantization_config, google/gemma-3-12b-it's
text_config, mistralai/Mixtral-8x7B-v0.1); the Llama-3.1 shapes are those of bench/throughput.py (8B) and
bench/tensor_parallel.py (70B).
"""

from __future__ import annotations

from typing import Any

from bench.kv_capacity import CONFIGS as ATTENTION_FIELDS
from bench.tensor_parallel import SHAPES as TP_SHAPES
from bench.throughput import SHAPES as THROUGHPUT_SHAPES

# Llama 3.1: bench/throughput.py's 8B shape (the one other benchmarks use) and bench/tensor_parallel.py's 70B sizes.
LLAMA_3_1_8B = dict(THROUGHPUT_SHAPES["llama-3.1-8b"], architectures=["LlamaForCausalLM"], model_type="llama")
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": LLAMA_3_1_8B,
    "llama-3.1-70b": dict(LLAMA_3_1_8B, **TP_SHAPES["70b"]),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "gpt-oss-20b": dict(
        **ATTENTION_FIELDS["gpt-oss-20b"],  # 24 layers, 8 kv heads of 64, window 128 on every other layer
        architectures=["GptOssForCausalLM"],
        vocab_size=201088,
        hidden_size=2880,
        num_attention_heads=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        attention_bias=True,
        swiglu_limit=7.0,
        max_position_embeddings=131072,
        rope_theta=150000,
        rope_scaling=dict(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_max_position_embeddings=4096,
            truncate=False,
        ),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=200002,
        pad_token_id=199999,
    ),
    "gemma-3-12b": dict(
        **ATTENTION_FIELDS["gemma-3-12b"],  # 48 layers, 8 kv heads of 256, window 1024, 5 local : 1 global
        architectures=["Gemma3ForCausalLM"],
        vocab_size=262208,
        hidden_size=3840,
        num_attention_heads=16,
        intermediate_size=15360,
        query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
    ),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
TINY_WINDOW = 16  # tokens: short enough that a CPU run's sequences outgrow it and window freeing shows


def tiny_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same family and quirks (layer pattern, sinks, experts, q/k norms) at a size a CPU runs in seconds:
    one full local/global pattern of layers, hidden 64, 8 experts top-2, window 16, vocab 512."""
    pattern = int(cfg.get("sliding_window_pattern") or (2 if cfg.get("sliding_window") else 1))
    tiny = dict(
        cfg,
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=max(2, pattern),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    )
    if "moe_intermediate_size" in cfg:
        tiny["moe_intermediate_size"] = 32
    for key in ("num_experts", "num_local_experts"):
        if key in cfg:
            tiny[key] = min(cfg[key], 8)
    if "num_experts_per_tok" in cfg:
        tiny["num_experts_per_tok"] = min(cfg["num_experts_per_tok"], 2)
    if cfg.get("sliding_window"):
        tiny["sliding_window"] = TINY_WINDOW
    if "query_pre_attn_scalar" in cfg:
        tiny["query_pre_attn_scalar"] = 16
    if "layer_types" in cfg:
        tiny["layer_types"] = cfg["layer_types"][: tiny["num_hidden_layers"]]
    return tiny
