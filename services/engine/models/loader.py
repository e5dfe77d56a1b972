"""`load_model`: a Hugging Face model directory -> one of our families, weights streamed in.

dtype "auto": the config's `torch_dtype`/`dtype` on CUDA (bf16 when the config says fp32, as
serving in fp32 on a GPU only wastes bandwidth), and always fp32 on CPU (CPU bf16/fp16 matmuls are
slow and the torch paged attention computes in fp32 anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.engine.models.base import CausalLM
from services.engine.models.falcon import FalconForCausalLM
from services.engine.models.fp8 import checkpoint_is_fp8, quantize_linears, skip_input_scales
from services.engine.models.gpt_neox import GPTNeoXForCausalLM
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.rotary import RotaryEmbedding
from services.engine.models.spec import ModelSpec, build_spec, read_json
from services.engine.models.weights import iter_checkpoint, load_tensors, load_weights, safetensors_files

if TYPE_CHECKING:
    from services.engine.parallel.state import ParallelContext

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "RWForCausalLM": FalconForCausalLM,  # Falcon checkpoints from before its transformers port
}


class UnsupportedArchitectureError(ValueError):
    pass


def resolve_dtype(dtype: torch.dtype | str, cfg: dict[str, Any], device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    config_dtype = _DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), torch.bfloat16)
    return torch.bfloat16 if config_dtype == torch.float32 else config_dtype


QUANTIZATIONS = ("none", "fp8")


def resolve_quantization(quantization: str | None, cfg: dict[str, Any]) -> str:
    """None/"none": fp8 only if the checkpoint is pre-quantised fp8; "fp8": always."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    return "fp8" if quantization == "fp8" or checkpoint_is_fp8(cfg) else "none"


def model_class(cfg: dict[str, Any]) -> type[CausalLM]:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise UnsupportedArchitectureError(
        f"architecture {archs or cfg.get('model_type')!r} is not supported; "
        f"supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    *,
    max_model_len: int | None = None,
    show_progress: bool = True,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    parallel: ParallelContext | None = None,
    random_weights_seed: int | None = None,
    quantization: str | None = None,
) -> CausalLM:
    """Build the family's module on the meta device, materialize it on `device`, stream weights in.

    `tensors` (checkpoint names, e.g. an HF module's `state_dict().items()`) replace the directory's
    safetensors files: benchmarks load random weights in memory (tensors already of the right dtype
    and device are adopted, not copied). `parallel` (world size > 1): build and load only this
    rank's shard (services/engine/parallel). `random_weights_seed`: deterministic random weights,
    the same for every tensor-parallel size (benchmarks). `quantization="fp8"` (or an fp8 checkpoint)
    loads the decoder layers' linears as FP8 (see models/fp8.py)."""
    model_dir, device = Path(model_dir), torch.device(device)
    cfg = read_json(model_dir / "config.json")
    cls = model_class(cfg)
    cfg = cls.normalize_config(cfg)
    spec: ModelSpec = build_spec(model_dir, cfg, resolve_dtype(dtype, cfg, device), max_model_len)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(spec.dtype)  # modules built on meta get the serving dtype, no fp32 detour
    try:
        with torch.device("meta"):
            model = cls.from_config(cfg, spec)
            if is_sharded := parallel is not None and parallel.world_size > 1:
                from services.engine.parallel.sharding import shard_model

                shard_model(model, parallel)
        is_fp8 = resolve_quantization(quantization, cfg) == "fp8"
        if is_fp8 and (cls is not LlamaForCausalLM or is_sharded or random_weights_seed is not None):
            raise ValueError("fp8 weights are supported for the Llama family, unsharded, loaded from weights "
                             f"(not {cls.__name__}, tensor parallel {is_sharded}, random {random_weights_seed})")
        if is_fp8:
            log.info("fp8 weights: %d linears", quantize_linears(model))
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    model.requires_grad_(False)
    if random_weights_seed is not None:
        from services.engine.parallel.loading import load_random

        load_random(model, random_weights_seed)
    elif is_sharded:
        from services.engine.parallel.loading import load_sharded

        if tensors is not None:
            raise ValueError("in-memory tensors cannot be loaded tensor-parallel; use files or random weights")
        load_sharded(model, safetensors_files(model_dir), show_progress)
    elif tensors is None:
        if is_fp8:
            load_tensors(model, skip_input_scales(iter_checkpoint(safetensors_files(model_dir), show_progress)),
                         str(model_dir))  # fmt: skip
        else:
            load_weights(model, safetensors_files(model_dir), show_progress)
    else:
        load_tensors(model, skip_input_scales(tensors) if is_fp8 else tensors, str(model_dir))
    if is_sharded and parallel is not None:
        from services.engine.parallel.sharding import local_spec

        model.spec = local_spec(spec, parallel)  # this rank's heads: sizes its KV cache
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_cache(device)
    return model.eval()
