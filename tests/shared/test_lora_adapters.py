"""Checking a PEFT adapter folder against the served limits from its config and safetensors header alone."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.shared.lora_adapters import LoRAAdapterError, inspect_adapter, parse_tensor_name


def _adapter(folder: Path, rank: int = 8, projs: tuple[str, ...] = ("q_proj", "down_proj"), **config: Any) -> Path:
    folder.mkdir()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, **config}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for proj in projs:
        module = "lm_head" if proj == "lm_head" else f"model.layers.0.self_attn.{proj}"
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.zeros(rank, 4)
        tensors[f"{prefix}.lora_B.weight"] = torch.zeros(4, rank)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_reads_rank_scaling_and_modules(tmp_path: Path) -> None:
    info = inspect_adapter(_adapter(tmp_path / "a"), max_rank=16)
    assert (info.rank, info.scaling, info.target_modules) == (8, 2.0, ("down_proj", "q_proj"))
    rslora = inspect_adapter(_adapter(tmp_path / "b", use_rslora=True), max_rank=8)
    assert rslora.scaling == pytest.approx(16 / math.sqrt(8))


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"rank": 32}, "rank 32 exceeds --max-lora-rank 16"),
        ({"projs": ("q_proj", "lm_head")}, "target module 'lm_head' is not supported"),
        ({"use_dora": True}, "DoRA adapters are not supported"),
        ({"bias": "all"}, "trained biases"),
    ],
)
def test_refuses_what_cannot_be_served(tmp_path: Path, kwargs: dict[str, Any], reason: str) -> None:
    with pytest.raises(LoRAAdapterError, match=reason):
        inspect_adapter(_adapter(tmp_path / "a", **kwargs), max_rank=16)


def test_names_of_peft_tensors() -> None:
    parsed = parse_tensor_name("base_model.model.model.layers.3.mlp.up_proj.lora_B.weight")
    assert parsed is not None and (parsed.module, parsed.proj, parsed.is_a) == ("model.layers.3.mlp", "up_proj", False)
    assert parse_tensor_name("model.layers.0.mlp.up_proj.weight") is None
