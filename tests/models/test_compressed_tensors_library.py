"""Checkpoints written by the compressed-tensors library itself (its ModelCompressor, as llm-compressor saves
them), not by our own writer: W4A16 and W8A16 `pack-quantized`, W8A8-INT8 `int-quantized` and FP8
`float-quantized`, by group, channel, tensor or block. Each loads into the layer its format names, every linear means
the weight the library's own fake quantization gives (`fake_quantize`), and where our path leaves activations
unquantized the tiny Llama generates what HF transformers generates with those weights."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from torch import nn
from transformers import PreTrainedModel

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.fp8 import Fp8Linear
from pagedserve.services.engine.models.int4 import Int4Linear
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.models.tiny_models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")
CASE = "llama-gqa-tied-llama3rope-sharded"
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TOKEN_ACTIVATIONS = {"num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
SCHEMES = {  # id: (weights, input activations, the layer our loader builds)
    "w4a16-group-asym": ({"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False}, None, Int4Linear),
    "w4a16-group-sym": ({"num_bits": 4, "strategy": "group", "group_size": 16, "symmetric": True}, None, Int4Linear),
    "w4a16-channel": ({"num_bits": 4, "strategy": "channel", "symmetric": True}, None, Int4Linear),
    "w8a16-channel": ({"num_bits": 8, "strategy": "channel", "symmetric": True}, None, nn.Linear),
    "w8a8-int8": ({"num_bits": 8, "strategy": "channel", "symmetric": True}, TOKEN_ACTIVATIONS, nn.Linear),
    "fp8-channel": (
        {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        {**TOKEN_ACTIVATIONS, "type": "float"},
        Fp8Linear,
    ),
    "fp8-block": (  # dequantised at load (no block-scaled GEMM): activations stay unquantized
        {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 16], "symmetric": True},
        {**TOKEN_ACTIVATIONS, "type": "float"},
        nn.Linear,
    ),
    "fp8-tensor": (
        {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
        {**TOKEN_ACTIVATIONS, "type": "float"},
        Fp8Linear,
    ),
}


def _library_checkpoint(model_dir: Path, weights: dict, activations: dict | None) -> tuple[PreTrainedModel, dict]:
    """Save a tiny Llama whose decoder linears the library quantized and compressed; returns HF's model with the
    weights the checkpoint means, and those weights by linear name."""
    hf = build_tiny_model(CASE, model_dir)
    reference = copy.deepcopy(hf)
    for path in model_dir.glob("*.safetensors*"):
        path.unlink()
    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(
        targets=["Linear"], weights=args, input_activations=QuantizationArgs(**activations) if activations else None
    )
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    meant = {}
    for name, module in hf.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        weight = module.weight.data
        if args.strategy == "group":  # min and max per group of inputs, as the library's weight observer takes them
            grouped = weight.reshape(weight.shape[0], -1, args.group_size)
            low, high = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "block":
            rows, cols = args.block_structure
            blocks = weight.reshape(weight.shape[0] // rows, rows, weight.shape[1] // cols, cols)
            low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
        elif args.strategy == "channel":
            low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
        else:
            low, high = weight.amin(), weight.amax()
        scale, zero_point = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        meant[name] = fake_quantize(weight, module.weight_scale, module.weight_zero_point, args)
        reference.get_parameter(f"{name}.weight").data.copy_(meant[name])
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(model_dir)
    compressor.update_config(str(model_dir))
    return reference, meant


def _dense_weight(layer: nn.Module) -> torch.Tensor:
    """What our layer multiplies by, [N, K]."""
    if isinstance(layer, Int4Linear):
        return layer.dequantized().T
    if isinstance(layer, Fp8Linear):
        return layer.weight.float() * layer.weight_scale[:, None]
    assert isinstance(layer, nn.Linear)
    return layer.weight


@pytest.mark.parametrize("scheme", SCHEMES)
def test_library_written_checkpoints_load_as_the_weights_they_mean(tmp_path: Path, scheme: str) -> None:
    weights, activations, layer_type = SCHEMES[scheme]
    reference, meant = _library_checkpoint(tmp_path, weights, activations)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    checked = set()
    for layer_index in range(reference.config.num_hidden_layers):
        for block in ("self_attn", "mlp"):
            prefix = f"model.layers.{layer_index}.{block}"
            for name, layer in ours.get_submodule(prefix).named_children():
                if not name.endswith("_proj"):
                    continue
                assert isinstance(layer, layer_type), (prefix, name, type(layer))
                parts = [f"{prefix}.{part}" for part in FUSED.get(name, (name,))]
                want = torch.cat([meant[part] for part in parts])
                torch.testing.assert_close(_dense_weight(layer), want, rtol=0, atol=1e-6, msg=f"{prefix}.{name}")
                checked.update(parts)
    assert checked == set(meant)  # every linear the library quantized, and nothing else
    if layer_type is Fp8Linear:
        return  # our fp8 path quantizes activations per token: HF's unquantized forward is no oracle for tokens
    config = Config.of(model=str(tmp_path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    prompts = [[5, 17, 42, 99, 3, 250, 8], [9, 1, 200]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [r.token_ids for r in Engine(config, model=ours).generate(prompts, params)]
    assert got == [hf_greedy(reference, p, 32) for p in prompts]
