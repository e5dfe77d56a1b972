"""4-bit AWQ and GPTQ tensors written from the formats' specifications (AutoAWQ's GEMM packing, AutoGPTQ's
v1 packing), independently of the loader's unpacking: what a downloaded checkpoint holds (and per-row FP8)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from pagedserve.services.engine.models import CausalLM
from pagedserve.services.engine.models.layers import ROUTER_NAMES
from tests.models.paged_driver import PagedDriver
from tests.models.tiny_models import build_tiny_model

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i <- column AWQ_PACK_ORDER[i] of the eight


def quantize(
    weight: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    min_zero: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [K, N] float -> (q [K, N], zeros [K/G, N], scales [K/G, N]): asymmetric 4-bit per group of rows, zero
    points from `min_zero` up."""
    k = weight.shape[0]
    groups = g_idx.long() if g_idx is not None else torch.arange(k) // group_size
    num_groups = k // group_size
    lo = torch.stack([weight[groups == g].min(dim=0).values for g in range(num_groups)])
    hi = torch.stack([weight[groups == g].max(dim=0).values for g in range(num_groups)])
    scales = ((hi - lo) / 15).clamp(min=1e-6)
    zeros = torch.round(-lo / scales).clamp(min_zero, 15)
    q = torch.round(weight / scales[groups] + zeros[groups]).clamp(0, 15)
    return q.to(torch.int64), zeros.to(torch.int64), scales


def _to_int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((values & 0xFFFFFFFF).astype(np.uint32).view(np.int32).copy())


def pack_columns(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, N] 4-bit -> [R, N/8] int32, nibble i <- column 8c + order[i]."""
    v = values.numpy().astype(np.int64)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.int64)
    for i, column in enumerate(order):
        packed |= v[:, column::8] << (4 * i)
    return _to_int32(packed)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[K, N] 4-bit -> [K/8, N] int32, nibble i <- row 8r + i (GPTQ)."""
    v = values.numpy().astype(np.int64)
    packed = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.int64)
    for i in range(8):
        packed |= v[i::8, :] << (4 * i)
    return _to_int32(packed)


def _meaning(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """W [K, N] float32 as the format defines it: (q - zero) * scale, from the quantizer's own values."""
    return (q - zeros[groups]).float() * scales[groups].float()


def awq_tensors(weight: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(checkpoint tensors, the W they mean)."""
    q, zeros, scales = quantize(weight, group_size)
    scales = scales.half()
    tensors = {
        "qweight": pack_columns(q, AWQ_PACK_ORDER),
        "qzeros": pack_columns(zeros, AWQ_PACK_ORDER),
        "scales": scales,
    }
    return tensors, _meaning(q, zeros, scales, torch.arange(weight.shape[0]) // group_size)


def gptq_tensors(
    weight: torch.Tensor,
    group_size: int,
    act_order: bool = False,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ v1 (zeros stored minus one); act order assigns rows to groups in a random order."""
    k = weight.shape[0]
    groups = torch.arange(k) // group_size
    g_idx = None
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = groups.to(torch.int32)
        groups = g_idx.long()
    # v1 stores z - 1, and a zero point of 0 would pack as -1 over its neighbours' nibbles: AutoGPTQ's own
    # packing has that flaw; we write what loads as meant (zero points from 1).
    q, zeros, scales = quantize(weight, group_size, g_idx, min_zero=1)
    scales = scales.half()
    tensors = {"qweight": pack_rows(q), "qzeros": pack_columns(zeros - 1), "scales": scales}
    if g_idx is not None:
        tensors["g_idx"] = g_idx
    return tensors, _meaning(q, zeros, scales, groups)


def pack_int4_signed(values: torch.Tensor, dim: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 for 4 bits: signed values (-8..7) stored as value + 8, eight per
    int32 along `dim` (1: the inputs, for weights; 0: the outputs, for zero points), value i at bits 4i."""
    unsigned = (values.to(torch.int64) + 8).numpy()
    if dim == 0:
        unsigned = unsigned.T
    packed = np.zeros((unsigned.shape[0], unsigned.shape[1] // 8), dtype=np.int64)
    for i in range(8):
        packed |= unsigned[:, i::8] << (4 * i)
    out = _to_int32(packed)
    return out.t().contiguous() if dim == 0 else out


def pack_quantized_tensors(
    weight: torch.Tensor,
    group_size: int,
    symmetric: bool,
    act_order: bool = False,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors "pack-quantized" int4 tensors of an HF weight [N, K] (group_size 0: per channel),
    and the weight [N, K] they mean: (q - z) * s with q, z signed; act order writes weight_g_idx."""
    n, k = weight.shape
    size = group_size or k
    groups = torch.arange(k) // size
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        groups = torch.empty(k, dtype=torch.int64)
        groups[perm] = torch.arange(k) // size
    members = [groups == g for g in range(k // size)]
    lo = torch.stack([weight[:, m].min(dim=1).values for m in members], dim=1)  # [N, K/G]
    hi = torch.stack([weight[:, m].max(dim=1).values for m in members], dim=1)
    if symmetric:  # compressed-tensors: amax over half the range, no zero point
        scales = (torch.maximum(lo.abs(), hi.abs()) / 7.5).clamp(min=1e-6)
        zeros = torch.zeros_like(scales)
    else:
        scales = ((hi - lo) / 15).clamp(min=1e-6)
        zeros = (torch.round(-lo / scales) - 8).clamp(-8, 7)
    scales = scales.half().float()  # what a half-precision checkpoint holds, and the meaning uses
    q = torch.round(weight / scales[:, groups] + zeros[:, groups]).clamp(-8, 7)
    tensors = {
        "weight_packed": pack_int4_signed(q, dim=1),
        "weight_scale": scales.half(),
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:
        tensors["weight_zero_point"] = pack_int4_signed(zeros, dim=0)
    if act_order:
        tensors["weight_g_idx"] = groups.to(torch.int32)
    return tensors, (q - zeros[:, groups]) * scales[:, groups]


def pack_quantized_config(group_size: int, symmetric: bool, act_order: bool = False) -> dict[str, object]:
    """config.json's quantization_config of such a checkpoint (as llm-compressor writes it)."""
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group" if group_size else "channel",
        "group_size": group_size or None,
        "actorder": "group" if act_order else None,
        "dynamic": False,
        "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"],
    }


def fp8_rows(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """HF's weight [N, K] -> per-row FP8 checkpoint tensors (e4m3 `weight`, float32 `weight_scale` [N, 1]: each
    row's amax maps to 448) and the [N, K] weight they mean."""
    scale = weight.abs().amax(dim=1, keepdim=True).float() / 448.0
    q = (weight / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


Quantize = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]  # HF [N, K] -> (tensors, meaning)


def in_hf_layout(pack: Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]], *args: object) -> Quantize:
    """A [K, N]-layout packer (awq_tensors, gptq_tensors) as `write_quantized_llama` takes one: HF's weight [N, K]
    -> (checkpoint tensors, the [N, K] weight they mean)."""

    def quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tensors, meaning = pack(weight.t().contiguous(), *args)
        return tensors, meaning.t().contiguous()

    return quantize


QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_quantized_llama(
    model_dir: Path,
    quantize: Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]],
    quantization_config: dict[str, Any] | None,
    keep_full: Callable[[str], bool] = lambda name: False,
) -> PreTrainedModel:
    """A tiny Llama whose decoder linears are rewritten by `quantize` (HF's weight [N, K] -> the linear's checkpoint
    tensors and the [N, K] weight they mean); returns HF's model holding the meant weights (the oracle).
    `quantization_config` goes into config.json (None: the caller writes the settings elsewhere); the weights
    `keep_full` names (e.g. model.layers.0.mlp.down_proj.weight) stay in full precision."""
    hf = build_tiny_model("llama-gqa-tied-llama3rope-sharded", model_dir)
    for path in [*model_dir.glob("*.safetensors"), *model_dir.glob("*.safetensors.index.json")]:
        path.unlink()
    written = {}
    for name, weight in hf.state_dict().items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue  # tied: the checkpoint holds the embedding once
        if not name.endswith(".weight") or name.split(".")[-2] not in QUANTIZED_LINEARS or keep_full(name):
            written[name] = weight.contiguous()
            continue
        tensors, meaning = quantize(weight)
        written.update({f"{name.removesuffix('.weight')}.{key}": value for key, value in tensors.items()})
        with torch.no_grad():
            hf.get_parameter(name).copy_(meaning)
    save_file(written, str(model_dir / "model.safetensors"))
    if quantization_config is not None:
        config = json.loads((model_dir / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (model_dir / "config.json").write_text(json.dumps(config))
    return hf


Convert = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def rewrite_decoder_linears(
    case: str, model_dir: Path, convert: Convert, quantization_config: dict[str, Any]
) -> PreTrainedModel:
    """The case's checkpoint with every decoder linear (experts per expert, as checkpoints store them; not routers)
    replaced by `convert(name, HF weight [N, K])`'s tensors (suffixes of its name's module) and the [N, K] weight
    they mean; returns HF's model on those meant weights (the oracle)."""
    source, meant = model_dir.parent / f"{model_dir.name}-source", model_dir.parent / f"{model_dir.name}-meant"
    build_tiny_model(case, source)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    written, meaning = {}, {}
    for name, weight in tensors.items():
        module = name.rsplit(".", 2)[-2]
        is_linear = ".layers." in name and name.endswith(".weight") and weight.dim() == 2 and "norm" not in module
        if not is_linear or module in ROUTER_NAMES:
            written[name] = meaning[name] = weight.contiguous()
            continue
        packed, meaning[name] = convert(name, weight)
        written.update({f"{name.removesuffix('.weight')}.{key}": value for key, value in packed.items()})
    config = json.loads((source / "config.json").read_text())
    for directory, state in ((model_dir, written), (meant, meaning)):
        directory.mkdir(exist_ok=True)
        save_file(state, str(directory / "model.safetensors"))
    (meant / "config.json").write_text(json.dumps(config))
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return AutoModelForCausalLM.from_pretrained(meant, dtype=torch.float32, attn_implementation="eager").eval()


def assert_logits_match_hf(
    ours: CausalLM, hf: PreTrainedModel, prompts: dict[int, list[int]], atol: float = 1e-4
) -> None:
    """Our paged forward's logits for each prompt equal HF's (rtol = atol)."""
    got = PagedDriver(ours).step(prompts)
    for index, prompt in prompts.items():
        with torch.inference_mode():
            want = hf(torch.tensor([prompt], device=got[index].device)).logits[0]
        torch.testing.assert_close(got[index].float(), want.float(), rtol=atol, atol=atol)
