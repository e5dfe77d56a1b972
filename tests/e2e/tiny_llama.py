"""A random 2-layer Llama with SmolLM2's tokenizer and chat template: fast on a CPU, served like any model."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def build_tiny_llama(out: Path, smollm2_dir: Path) -> Path:
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return copy_tokenizer(smollm2_dir, out)


def copy_tokenizer(smollm2_dir: Path, out: Path) -> Path:
    """SmolLM2's tokenizer and chat template beside a random model of its vocabulary (49152 ids)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, out / name)
    return out
