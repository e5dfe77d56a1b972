"""Engine test fixtures: models loaded once per session (SmolLM2 and a tiny random Llama)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.shared.config import Config


@pytest.fixture(scope="session")
def smol_model(smollm2_dir: Path) -> CausalLM:
    return load_model(smollm2_dir, torch.float32, "cpu", show_progress=False)


@pytest.fixture(scope="session")
def hf_smol(smollm2_dir: Path):  # HF transformers: the correctness oracle
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare fixed lengths: never stop early
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (vocab 256, EOS 2): fast enough for thousands of requests."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.5,  # sharper logits than the default, so tokens depend on the context
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> CausalLM:
    return load_model(tiny_model_dir, torch.float32, "cpu", show_progress=False)


@pytest.fixture()
def engine(tiny_model: CausalLM, tiny_model_dir: Path) -> Engine:
    """A small paged engine over the tiny model (64 blocks of 4 tokens)."""
    return Engine(Config.of(model=str(tiny_model_dir), num_kv_blocks=64, block_size=4), model=tiny_model)
