"""Random PEFT LoRA adapters for a tiny Llama, written by `peft` itself (the format the engines read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(
    base_dir: Path,
    out: Path,
    rank: int,
    seed: int,
    use_rslora: bool = False,
    target_modules: list[str] | None = None,
) -> Path:
    """A rank-`rank` adapter with random A and B (B nonzero, unlike PEFT's training init)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=target_modules or ALL_MODULES,
        lora_dropout=0.0,
        init_lora_weights=False,
        use_rslora=use_rslora,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    return out


def merged_model(base_dir: Path, adapter_dir: Path | None) -> Any:  # a transformers PreTrainedModel
    """HF's model with the adapter merged into its weights (PEFT's merge_and_unload): the oracle."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.generation_config.eos_token_id = None  # fixed lengths: never stop early
    model.generation_config.pad_token_id = 0
    return model.eval()
