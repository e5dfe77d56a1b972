"""What a PEFT LoRA adapter folder holds, checked against the served limits without loading a tensor.

    adapter_config.json          r, lora_alpha, use_rslora, target_modules, ...
    adapter_model.safetensors    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
                                 base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]

The gateway checks a runtime load with it (a 400 names the reason before any engine is asked) and the
engines check again when they read the weights. Only the safetensors header is parsed here (a JSON
prefix), so the gateway needs no torch.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names in Llama-family checkpoints; the engine maps them onto its fused projections.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:(?P<module>.+)\.)?(?P<proj>\w+)\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$"
)
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the reason (the API answers 400)."""


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]  # PEFT projection names present in the weights
    tensor_shapes: dict[str, tuple[int, ...]]  # checkpoint name -> shape


@dataclass(frozen=True, slots=True)
class LoRATensorName:
    module: str  # e.g. model.layers.3.self_attn
    proj: str  # e.g. q_proj
    is_a: bool  # lora_A (else lora_B)


def parse_tensor_name(name: str) -> LoRATensorName | None:
    match = _TENSOR_NAME.match(name)
    if match is None:
        return None
    return LoRATensorName(match["module"] or "", match["proj"], match["ab"] == "A")


def inspect_adapter(path: str | Path, max_rank: int) -> AdapterInfo:
    """The adapter's rank, scaling and target modules; LoRAAdapterError if it is unreadable or beyond the limits."""
    folder = Path(path)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"no readable {CONFIG_FILE} in the adapter folder ({type(exc).__name__})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError("not a LoRA adapter (peft_type must be LORA)")
    for key, why in (
        ("use_dora", "DoRA adapters are not supported"),
        ("fan_in_fan_out", "fan_in_fan_out adapters are not supported"),
        ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
        ("modules_to_save", "adapters that replace whole modules (modules_to_save) are not supported"),
    ):
        if config.get(key):
            raise LoRAAdapterError(why)
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError("adapters with trained biases are not supported (bias must be 'none')")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError("adapter_config.json: r must be a positive integer")
    if rank > max_rank:
        raise LoRAAdapterError(f"the adapter's rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    shapes = _safetensors_shapes(folder / WEIGHTS_FILE)
    modules: set[str] = set()
    for name, shape in shapes.items():
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise LoRAAdapterError(f"unexpected tensor {name!r}: only LoRA A/B weights are supported")
        if parsed.proj not in SUPPORTED_MODULES:
            raise LoRAAdapterError(
                f"target module {parsed.proj!r} is not supported (supported: {', '.join(SUPPORTED_MODULES)})"
            )
        rank_dim = shape[0] if parsed.is_a else shape[-1]
        if len(shape) != 2 or rank_dim != rank:
            raise LoRAAdapterError(f"tensor {name!r} of shape {list(shape)} does not match rank {rank}")
        modules.add(parsed.proj)
    if not modules:
        raise LoRAAdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return AdapterInfo(str(folder), rank, scaling, tuple(sorted(modules)), shapes)


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors header (8-byte little-endian length, then JSON)."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER_BYTES:
                raise ValueError("header too large")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise LoRAAdapterError(f"no readable {WEIGHTS_FILE} in the adapter folder ({type(exc).__name__})") from None
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
