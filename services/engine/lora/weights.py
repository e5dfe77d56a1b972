"""A PEFT adapter's tensors, read once to the host and keyed by where they go in our model.

    base_model.model.model.layers.3.self_attn.k_proj.lora_A.weight   ->  ("model.layers.3.self_attn.qkv_proj", 1)
    base_model.model.model.layers.3.mlp.down_proj.lora_B.weight      ->  ("model.layers.3.mlp.down_proj", 0)

Checked first by shared/lora_adapters.py (rank, supported modules) without reading a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from pagedserve.shared.lora_adapters import WEIGHTS_FILE, AdapterInfo, LoRAAdapterError, parse_tensor_name

# PEFT projection -> (our projection beside it, slice index in that projection's stacked outputs)
TARGET_SLICES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


@dataclass(slots=True)
class AdapterWeights:
    info: AdapterInfo
    # (our module path, slice index) -> (A [r, in], B [width, r] times the adapter's scaling)
    slices: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_adapter(info: AdapterInfo) -> AdapterWeights:
    tensors = load_file(str(Path(info.path) / WEIGHTS_FILE))
    halves: dict[tuple[str, int], dict[bool, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        parsed = parse_tensor_name(name)
        assert parsed is not None and parsed.proj in TARGET_SLICES  # inspect_adapter checked both
        ours, index = TARGET_SLICES[parsed.proj]
        halves.setdefault((f"{parsed.module}.{ours}", index), {})[parsed.is_a] = tensor
    weights = AdapterWeights(info)
    for key, pair in halves.items():
        if set(pair) != {True, False}:
            raise LoRAAdapterError(f"{key[0]}: the adapter has only one of lora_A / lora_B")
        weights.slices[key] = (pair[True].float(), pair[False].float() * info.scaling)
    return weights
