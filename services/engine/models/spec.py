"""`ModelSpec`: the facts about a loaded model that the engine needs (cache shapes, limits, EOS)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(slots=True)
class ModelSpec:
    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    max_model_len: int  # longest context the engine may build: <= max_position_embeddings
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    # Sampling defaults the checkpoint ships in generation_config.json (temperature, top_p, top_k, ...).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # Per layer: the sliding window of a local layer, None for a global one (empty: all global). The
    # attention type per layer for the attention backends and the KV cache groups (kv_cache_groups.py:
    # local layers hold blocks of their own, freed once out of the window).
    layer_windows: tuple[int | None, ...] = ()

    @property
    def max_position(self) -> int:  # the name the engine contract uses
        return self.max_position_embeddings

    @property
    def window_of_every_layer(self) -> int | None:
        """The largest window when every layer slides (then a sequence needs no older blocks), else None."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(w for w in self.layer_windows if w is not None)

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window; None for a global layer."""
        return self.layer_windows[layer] if self.layer_windows else None

    def kv_bytes_per_token(self, cache_dtype: torch.dtype | None = None) -> int:
        """Bytes one token's K and V take over all layers (sizes the paged cache)."""
        itemsize = torch.empty((), dtype=cache_dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def first_key(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first key present (HF families name the same thing differently)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


# Older AutoGPTQ / AutoAWQ exports keep the quantization settings beside config.json, not in it.
QUANTIZATION_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))
_AWQ_KEYS = ("w_bit", "q_group_size", "zero_point", "version")  # AutoAWQ's names (GPTQ's: bits, group_size, ...)
# quant_method spellings that name a method we read under another name (vLLM normalises these too):
# compressed-tensors' own older exports, and fbgemm's per-row FP8 (Llama-3.1-405B-FP8) read as FP8.
_METHOD_ALIASES = {"compressed_tensors": "compressed-tensors", "fbgemm_fp8": "fp8"}


def read_model_config(model_dir: Path) -> dict[str, Any]:
    """config.json with its quantization settings in one place, `quantization_config`: taken from
    `compression_config` (older compressed-tensors exports), else from quantize_config.json (AutoGPTQ; AutoAWQ
    when its keys say so) or quant_config.json (AutoAWQ) beside it; quant_method lower-case and in our spelling."""
    cfg = read_json(model_dir / "config.json")
    qc = cfg.get("quantization_config") or cfg.get("compression_config")
    if not qc:
        for name, method in QUANTIZATION_FILES:
            path = model_dir / name
            if path.is_file():
                found = read_json(path)
                implied = "awq" if any(key in found for key in _AWQ_KEYS) else method
                qc = {"quant_method": implied, **found}  # the file's own quant_method wins
                break
    if not qc:
        return cfg
    return {**cfg, "quantization_config": normalized_quantization_config(qc)}


def normalized_quantization_config(qc: dict[str, Any]) -> dict[str, Any]:
    """quant_method lower-case and in our spelling ("GPTQ" -> "gptq", "compressed_tensors" -> "compressed-tensors",
    "fbgemm_fp8" -> "fp8" with fbgemm's unconverted modules)."""
    method = qc.get("quant_method")
    if not isinstance(method, str):
        return qc
    method = method.lower()
    return {**qc, "quant_method": _METHOD_ALIASES.get(method, method)}


_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "do_sample")


def generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    return read_json(path) if path.exists() else {}


def eos_token_ids(model_dir: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what HF generate stops on), else config.json."""
    eos = generation_config(model_dir).get("eos_token_id")
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(i) for i in eos) if isinstance(eos, list) else (int(eos),)


def sliding_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer windows from the Llama-style keys, as transformers reads them: `sliding_window` on every
    layer (Mistral, Phi-3), or on the layers `layer_types` marks "sliding_attention" (Qwen2, whose older
    configs say `max_window_layers`: layers from there on slide); none when `use_sliding_window` is false.
    Families with their own rule (Gemma, gpt-oss) put `layer_windows` in the config instead."""
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", True):
        return ()
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= int(cfg.get("max_window_layers") or 0) else "full_attention"
        for i in range(num_layers)
    ]
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def build_spec(model_dir: Path, cfg: dict[str, Any], dtype: torch.dtype, max_model_len: int | None) -> ModelSpec:
    """Spec from a config already normalised by its family (canonical Llama-style key names)."""
    num_heads = int(cfg["num_attention_heads"])
    hidden_size = int(cfg["hidden_size"])
    max_position = int(cfg.get("max_position_embeddings") or 2048)
    num_layers = int(cfg["num_hidden_layers"])
    layer_windows = tuple(cfg.get("layer_windows") or ()) or sliding_windows(cfg, num_layers)
    if max_model_len is None:
        max_model_len = max_position
    elif max_model_len > max_position:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {max_position} "
            f"({model_dir / 'config.json'})"
        )
    return ModelSpec(
        architecture=cfg["architectures"][0],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
        hidden_size=hidden_size,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=max_position,
        max_model_len=max_model_len,
        dtype=dtype,
        eos_token_ids=eos_token_ids(model_dir, cfg),
        bos_token_id=cfg.get("bos_token_id"),
        generation_defaults={k: v for k, v in generation_config(model_dir).items() if k in _SAMPLING_KEYS},
        layer_windows=layer_windows,
    )
