"""`load_model`: a Hugging Face model directory -> one of our families, weights streamed in.

dtype "auto": the config's `torch_dtype`/`dtype` on CUDA (bf16 when the config says fp32, as
serving in fp32 on a GPU only wastes bandwidth), and always fp32 on CPU (CPU bf16/fp16 matmuls are
slow and the torch paged attention computes in fp32 anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.models.compressed_int8 import int8_stream, int8_weights_format
from pagedserve.services.engine.models.compressed_tensors import gptq_stream, ignored, pack_quantized_format
from pagedserve.services.engine.models.falcon import FalconForCausalLM
from pagedserve.services.engine.models.fp8 import (
    checkpoint_is_fp8,
    dequantize_experts,
    e4m3_only,
    fp8_kept_linears,
    quantize_linears,
    skip_input_scales,
)
from pagedserve.services.engine.models.fp8_block import block_fp8_format, block_fp8_stream
from pagedserve.services.engine.models.gemma import GemmaForCausalLM
from pagedserve.services.engine.models.gpt_neox import GPTNeoXForCausalLM
from pagedserve.services.engine.models.gpt_oss import GptOssForCausalLM
from pagedserve.services.engine.models.gptq8 import gptq8_format, gptq8_stream
from pagedserve.services.engine.models.int4 import (
    Int4Linear,
    int4_format,
    quantize_linears_int4,
    repack_experts,
    unconverted_linears,
)
from pagedserve.services.engine.models.int4 import dequantize_experts as dequantize_int4_experts
from pagedserve.services.engine.models.kv_cache_scales import KVCacheScales
from pagedserve.services.engine.models.llama import LlamaForCausalLM
from pagedserve.services.engine.models.llama_moe import MoeForCausalLM
from pagedserve.services.engine.models.mxfp4 import PACKED_EXPERTS_KEY, checkpoint_is_mxfp4, keeps_experts_packed
from pagedserve.services.engine.models.phi3 import Phi3ForCausalLM
from pagedserve.services.engine.models.quantized_experts import (
    INT4_METHODS,
    QUANTIZED_EXPERTS_KEY,
    experts_quantization,
    int4_act_order,
)
from pagedserve.services.engine.models.rotary import RotaryEmbedding
from pagedserve.services.engine.models.spec import ModelSpec, build_spec, read_model_config
from pagedserve.services.engine.models.weights import iter_checkpoint, load_tensors, safetensors_files
from pagedserve.services.engine.parallel.fp8 import shard_linears_fp8
from pagedserve.services.engine.parallel.int4 import shard_linears_int4
from pagedserve.services.engine.parallel.loading import load_random, load_sharded, load_sharded_stream
from pagedserve.services.engine.parallel.sharding import local_spec, shard_model

if TYPE_CHECKING:
    from pagedserve.services.engine.parallel.state import ParallelContext

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
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Gemma3ForConditionalGeneration": GemmaForCausalLM,  # refused in normalize_config: vision
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "RWForCausalLM": FalconForCausalLM,  # Falcon checkpoints from before its transformers port
    # Bare decoders, as embedding models ship (weights without `model.`, no LM head): served for pooling
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
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


QUANTIZATIONS = ("none", "fp8", "awq", "gptq", "compressed-tensors", "mxfp4")
# What 8-bit int checkpoints resolve to (`--quantization gptq` / `compressed-tensors` name them), dequantised at
# load: models/gptq8.py, models/compressed_int8.py.
GPTQ8 = "gptq-8bit"
CT_INT8 = "compressed-tensors-int8"
FP8_BLOCK = "fp8-block"  # block-wise FP8 checkpoints, dequantised at load: models/fp8_block.py


def resolve_quantization(quantization: str | None, cfg: dict[str, Any]) -> str:
    """None/"none": as the checkpoint is (fp8, awq, gptq, compressed-tensors (int4), mxfp4 or none); "fp8": always;
    "awq"/"gptq"/"compressed-tensors"/"mxfp4": the checkpoint must be one (vLLM's --quantization names the
    checkpoint's method; a compressed-tensors checkpoint of fp8 weights resolves to "fp8")."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    qc = cfg.get("quantization_config") or {}
    found = qc.get("quant_method", "none")
    _refuse_compressed_sparsity(qc)
    if quantization in ("awq", "gptq", "compressed-tensors", "mxfp4") and found != quantization:
        raise ValueError(f"quantization {quantization!r}: the checkpoint's weights are {found!r}")
    method = _prequantized_method(cfg)
    if method is not None and quantization == "fp8":  # vLLM refuses this mismatch too: never a silent no-op
        raise ValueError(
            f"quantization 'fp8': the checkpoint's weights are already quantized ({method}); leave --quantization "
            "unset (or name the checkpoint's method) to serve them as they are"
        )
    if method is not None:
        return method
    if block_fp8_format(cfg) is not None:  # before "fp8": `--quantization fp8` names this checkpoint's method too
        return FP8_BLOCK
    if checkpoint_is_fp8(cfg):
        return "fp8"
    _refuse_unread_weights(qc)  # before online fp8: it would quantize what it misreads
    if quantization == "fp8":
        return "fp8"
    if quantization == "compressed-tensors":
        raise ValueError("quantization 'compressed-tensors': the checkpoint's weights are not quantized")
    return "none"


def _prequantized_method(cfg: dict[str, Any]) -> str | None:
    """The checkpoint's own non-FP8 weight format, if it has one."""
    if checkpoint_is_mxfp4(cfg):
        return "mxfp4"
    if gptq8_format(cfg) is not None:
        return GPTQ8
    if int8_weights_format(cfg) is not None:
        return CT_INT8
    if (int4 := int4_format(cfg)) is not None:
        return int4[0]
    if pack_quantized_format(cfg) is not None:
        return "compressed-tensors"
    return None


def _refuse_compressed_sparsity(qc: dict[str, Any]) -> None:
    """compressed-tensors checkpoints may store sparse weights compressed (bitmask, 2:4): refused at start, naming
    the format, rather than at load on the first tensor the readers do not know. Dense storage loads as usual."""
    sparsity = qc.get("sparsity_config") or {}
    if qc.get("quant_method") == "compressed-tensors" and sparsity.get("format", "dense") != "dense":
        raise ValueError(
            f"quantization: compressed-tensors sparse weights (format {sparsity['format']!r}) are not supported: "
            "dense storage only"
        )


def _refuse_unread_weights(qc: dict[str, Any]) -> None:
    """A quantization_config none of the readers above took: its weights would load as garbage, so refuse it
    (a compressed-tensors config that quantizes no weights, e.g. an fp8 KV cache only, loads as full precision)."""
    method = qc.get("quant_method")
    if method is None:
        return
    if method == "compressed-tensors":
        weights = [g.get("weights") for g in (qc.get("config_groups") or {}).values() if g.get("weights")]
        if not weights:
            return
        schemes = {f"{w.get('type', 'int')} {w.get('num_bits')}-bit {w.get('strategy', '')}".strip() for w in weights}
        found = sorted(schemes)
        raise ValueError(
            f"quantization: compressed-tensors weights {found} (format {qc.get('format')!r}) are not supported: "
            "float 8-bit (tensor, channel or block scales), int 4-bit pack-quantized (W4A16), int 8-bit (W8A8-INT8, "
            "W8A16)"
        )
    raise ValueError(
        f"quantization: the checkpoint's method {method!r} is not supported (awq, gptq, fp8, compressed-tensors, mxfp4)"
    )


def _int4_linears(model: CausalLM, method: str, cfg: dict[str, Any], sharded: bool) -> int:
    """Swap the decoder's linears (this rank's shards, if `sharded`) for the checkpoint's 4-bit layout; returns
    how many."""
    keep: Callable[[str], bool] | None
    if method == "compressed-tensors":
        scheme = pack_quantized_format(cfg)
        assert scheme is not None
        fmt, group_size, zero_offset, keep = "gptq", scheme.group_size, 0, ignored(scheme)
    else:
        fmt, group_size, zero_offset = int4_format(cfg) or (method, 0, 0)
        keep = unconverted_linears(cfg)
    if sharded:
        return shard_linears_int4(model, fmt, group_size, zero_offset, keep, act_order=int4_act_order(cfg))
    return quantize_linears_int4(model, fmt, group_size, zero_offset, keep)


def _checkpoint_stream(
    tensors: Iterable[tuple[str, torch.Tensor]], method: str, cfg: dict[str, Any]
) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model's modules take them: quantized experts (cfg's
    QUANTIZED_EXPERTS_KEY) in their kernel layout, else dequantised to full precision as they stream in."""
    keep_experts = cfg.get(QUANTIZED_EXPERTS_KEY) is not None
    if method == GPTQ8:
        group_size, zero_offset = gptq8_format(cfg) or (0, 0)
        return gptq8_stream(tensors, group_size, zero_offset, act_order=int4_act_order(cfg))
    if method == CT_INT8 and (int8 := int8_weights_format(cfg)) is not None:
        return int8_stream(tensors, int8)
    if method == FP8_BLOCK and (block := block_fp8_format(cfg)) is not None:
        return block_fp8_stream(e4m3_only(tensors), block)
    if method == "fp8":
        tensors = skip_input_scales(e4m3_only(tensors))
        return tensors if keep_experts else dequantize_experts(tensors)
    if method == "compressed-tensors" and (scheme := pack_quantized_format(cfg)) is not None:
        int4: tuple[str, int, int] | None = ("gptq", scheme.group_size, 0)  # converted to GPTQ's tensors
        tensors = gptq_stream(tensors, scheme)
    elif method in ("awq", "gptq"):
        int4 = int4_format(cfg)
    else:
        return tensors
    assert int4 is not None
    if keep_experts:
        return repack_experts(tensors, *int4)
    return dequantize_int4_experts(tensors, *int4, act_order=int4_act_order(cfg))


def model_class(cfg: dict[str, Any]) -> type[CausalLM]:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise UnsupportedArchitectureError(
        f"architecture {archs or cfg.get('model_type')!r} is not supported; "
        f"supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def is_bare_decoder(cfg: dict[str, Any]) -> bool:
    """A checkpoint of the decoder alone (`Qwen3Model`, as embedding models ship): it can only pool."""
    archs = cfg.get("architectures") or []
    return bool(archs) and all(str(a).endswith("Model") for a in archs)


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
    mxfp4_packed: bool | None = None,
    quantized_experts: bool | None = None,
) -> CausalLM:
    """Build the family's module on the meta device, materialize it on `device`, stream weights in.

    `tensors` (checkpoint names, e.g. an HF module's `state_dict().items()`) replace the directory's safetensors
    files: benchmarks load random weights in memory (tensors already of the right dtype and device are adopted, not
    copied). `parallel` (world size > 1): build and load only this rank's shard (services/engine/parallel).
    `random_weights_seed`: deterministic random weights, the same for every tensor-parallel size (benchmarks), in
    the quantized layout where there is one. `quantization="fp8"` (or an fp8 checkpoint) loads the decoder layers'
    linears as FP8 (see models/fp8.py). MXFP4 checkpoints (gpt-oss): the experts stay 4-bit on the device if
    `mxfp4_packed`, are dequantised at load if False; None: packed on CUDA when the dequantised experts would not
    fit half the device (mxfp4.keeps_experts_packed). fp8 and 4-bit MoE experts stay quantized in the fused-MoE
    kernel's layouts if `quantized_experts`, are dequantised at load if False; None: quantized on CUDA
    (quantized_experts.experts_quantization)."""
    model_dir, device = Path(model_dir), torch.device(device)
    cfg = read_model_config(model_dir)
    cls = model_class(cfg)
    cfg = cls.normalize_config(cfg)
    if is_bare_decoder(cfg):  # no LM head to load: logits (never asked of a pooling engine) would read the embeddings
        cfg = {**cfg, "tie_word_embeddings": True}
    if checkpoint_is_mxfp4(cfg):  # the family builds packed or dense expert parameters from this
        cfg = {**cfg, PACKED_EXPERTS_KEY: keeps_experts_packed(device, mxfp4_packed, cfg)}
    method = resolve_quantization(quantization, cfg)
    is_sharded = parallel is not None and parallel.world_size > 1
    if (experts := experts_quantization(method, cfg, device, quantized_experts)) is not None:
        cfg = {**cfg, QUANTIZED_EXPERTS_KEY: experts}  # MoE families build fp8 / int4 experts from this
    spec: ModelSpec = build_spec(model_dir, cfg, resolve_dtype(dtype, cfg, device), max_model_len)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(spec.dtype)  # modules built on meta get the serving dtype, no fp32 detour
    try:
        with torch.device("meta"):
            model = cls.from_config(cfg, spec)
            if is_sharded:
                assert parallel is not None
                shard_model(model, parallel)
        if method == "mxfp4" and not cls.loads_mxfp4:
            raise ValueError(f"mxfp4 weights: only gpt-oss's experts load from MXFP4, not {cls.__name__}'s")
        if method in INT4_METHODS:
            log.info("%s 4-bit weights: %d linears", method, _int4_linears(model, method, cfg, is_sharded))
        if method == "fp8":
            swap_fp8 = shard_linears_fp8 if is_sharded else quantize_linears
            log.info("fp8 weights: %d linears", swap_fp8(model, fp8_kept_linears(cfg)))
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    model.requires_grad_(False)
    if random_weights_seed is not None:
        load_random(model, random_weights_seed)
    elif is_sharded and tensors is not None:
        raise ValueError("in-memory tensors cannot be loaded tensor-parallel; use files or random weights")
    elif is_sharded and method == "none":  # each rank reads only its slices of the files
        load_sharded(model, safetensors_files(model_dir), show_progress)
    else:
        kv_scales = KVCacheScales()
        stream = iter_checkpoint(safetensors_files(model_dir), show_progress) if tensors is None else tensors
        checkpoint = _checkpoint_stream(kv_scales.taken_from(stream), method, cfg)
        if is_sharded:  # quantized: whole tensors through the format's converters, each cut to this rank's slice
            load_sharded_stream(model, checkpoint, str(model_dir))
        else:
            load_tensors(model, checkpoint, str(model_dir))
        kv_scales.apply(model)
    if is_sharded and parallel is not None:
        model.spec = local_spec(spec, parallel)  # this rank's heads: sizes its KV cache
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_cache(device)
        elif isinstance(module, Int4Linear):  # every shard is in: repack to the kernels' one layout
            module.finish_loading()
    return model.eval()
