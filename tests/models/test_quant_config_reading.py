"""Quantization settings as real checkpoints spell them: quant_method in any case or alias, compressed-tensors'
older `compression_config`, AutoAWQ's keys in quantize_config.json, static KV-cache scales beside any weight
format, and `--quantization fp8` on weights already quantized otherwise (refused, as vLLM does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.fp8 import Fp8Linear
from pagedserve.services.engine.models.int4 import Int4Linear
from pagedserve.services.engine.models.kv_cache_scales import KVCacheScales
from pagedserve.services.engine.models.layers import Attention
from pagedserve.services.engine.models.loader import resolve_quantization
from pagedserve.services.engine.models.spec import read_model_config
from tests.models.int4_checkpoints import assert_logits_match_hf, fp8_rows, gptq_tensors, write_quantized_llama

pytestmark = pytest.mark.usefixtures("one_thread")
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}


def _write_config(model_dir: Path, config: dict[str, Any], **beside: dict[str, Any]) -> None:
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    for name, content in beside.items():
        (model_dir / f"{name}.json").write_text(json.dumps(content))


@pytest.mark.parametrize(
    ("written", "read"),
    [
        ("GPTQ", "gptq"),
        ("AWQ", "awq"),
        ("compressed_tensors", "compressed-tensors"),
        ("Compressed-Tensors", "compressed-tensors"),
        ("fbgemm_fp8", "fp8"),
        ("FP8", "fp8"),
    ],
)
def test_quant_method_is_read_lower_case_and_in_our_spelling(tmp_path: Path, written: str, read: str) -> None:
    _write_config(tmp_path, {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": written}})
    assert read_model_config(tmp_path)["quantization_config"]["quant_method"] == read


def test_compression_config_of_older_compressed_tensors_exports_is_the_quantization_config(tmp_path: Path) -> None:
    groups = {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}
    compression = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups}
    _write_config(tmp_path, {"architectures": ["LlamaForCausalLM"], "compression_config": compression})
    cfg = read_model_config(tmp_path)
    assert cfg["quantization_config"]["config_groups"] == groups
    assert resolve_quantization(None, cfg) == "fp8"
    assert resolve_quantization("fp8", cfg) == "fp8"


@pytest.mark.parametrize(
    ("beside", "method"),
    [
        ({"w_bit": 4, "q_group_size": 128, "zero_point": True, "version": "GEMM"}, "awq"),  # AutoAWQ's own keys
        ({"bits": 4, "group_size": 128, "desc_act": False, "sym": True}, "gptq"),  # AutoGPTQ's
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),  # the file says which
    ],
)
def test_quantize_config_json_beside_the_config_is_read_by_its_keys(
    tmp_path: Path, beside: dict[str, Any], method: str
) -> None:
    _write_config(tmp_path, {"architectures": ["LlamaForCausalLM"]}, quantize_config=beside)
    assert read_model_config(tmp_path)["quantization_config"]["quant_method"] == method


def test_fp8_flag_on_weights_quantized_otherwise_is_refused(tmp_path: Path) -> None:
    _write_config(tmp_path, {"architectures": ["LlamaForCausalLM"], "quantization_config": GPTQ})
    cfg = read_model_config(tmp_path)
    assert resolve_quantization(None, cfg) == "gptq"
    with pytest.raises(ValueError, match=r"quantization 'fp8'.*already quantized \(gptq\)"):
        resolve_quantization("fp8", cfg)


def test_static_kv_cache_scales_beside_4bit_weights_go_to_the_attention(tmp_path: Path) -> None:
    """llm-compressor writes k_scale / v_scale (kv_cache_scheme) whatever the weights' format (per head: the
    layer takes the largest); older FP8 exports name them k_proj / v_proj.output_scale."""
    hf = write_quantized_llama(tmp_path, lambda w: _transposed(gptq_tensors(w.t().contiguous(), 32)), None)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.5, 0.75])  # per KV head
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.125])
    tensors["model.layers.1.self_attn.v_proj.output_scale"] = torch.tensor([2.0])
    tensors["model.layers.1.self_attn.q_scale"] = torch.tensor(3.0)  # fp8 attention math: not used
    save_file(tensors, str(path))
    kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {**GPTQ, "kv_cache_scheme": kv_scheme}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    assert sum(isinstance(m, Int4Linear) for m in ours.modules()) == 2 * 4
    attentions = [m for m in ours.modules() if isinstance(m, Attention)]
    assert [(a.k_scale, a.v_scale) for a in attentions] == [(0.25, 0.75), (0.125, 2.0)]
    assert_logits_match_hf(ours, hf, {0: [5, 17, 42, 99, 3], 1: [9, 1, 200]})  # an fp32 cache ignores them


def _transposed(written: tuple[dict[str, torch.Tensor], torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """gptq_tensors works on [K, N]; write_quantized_llama's weights and meanings are HF's [N, K]."""
    tensors, meaning = written
    return tensors, meaning.t()


def test_fbgemm_fp8_checkpoint_loads_its_per_row_weights_and_keeps_what_it_did_not_convert(tmp_path: Path) -> None:
    """Llama-3.1-405B-FP8's format: per-row FP8 weights with an activation bound per linear (input_scale_ub), the
    attention left in full precision (modules_to_not_convert)."""

    def per_row(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tensors, meaning = fp8_rows(weight)
        return {**tensors, "input_scale_ub": torch.tensor(1200.0)}, meaning

    config = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["self_attn"]}
    hf = write_quantized_llama(tmp_path, per_row, config, keep_full=lambda name: ".self_attn." in name)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    kinds = {
        name: type(module).__name__ for name, module in ours.named_modules() if name.endswith(("qkv_proj", "down_proj"))
    }
    assert {kind for name, kind in kinds.items() if "qkv_proj" in name} == {"ShardedLinear"}  # not converted
    assert {kind for name, kind in kinds.items() if "down_proj" in name} == {"Fp8Linear"}
    for layer in range(hf.config.num_hidden_layers):
        got = ours.get_submodule(f"model.layers.{layer}.mlp.down_proj")
        assert isinstance(got, Fp8Linear)
        want = hf.get_parameter(f"model.layers.{layer}.mlp.down_proj.weight")
        torch.testing.assert_close(got.weight.float() * got.weight_scale[:, None], want, atol=0, rtol=0)


def test_kv_cache_scale_names_and_their_meaning() -> None:
    scales = KVCacheScales()
    stream = [
        ("model.layers.0.self_attn.kv_scale", torch.tensor(3.0)),  # one scale for K and V (older exports)
        ("model.layers.0.self_attn.q_scale", torch.tensor(9.0)),  # fp8 attention math: claimed, not used
        ("transformer.h.1.self_attention.k_scale", torch.tensor([1.0, 4.0])),  # Falcon's names; per head
        ("model.layers.0.mlp.down_proj.weight_scale", torch.tensor(7.0)),  # a weight's scale: not ours
    ]
    kept = [name for name, _ in scales.taken_from(stream)]
    assert kept == ["model.layers.0.mlp.down_proj.weight_scale"]
    assert scales.by_layer == {0: {"kv": 3.0}, 1: {"k": 4.0}}


@pytest.mark.parametrize("fmt", ["sparse-24-bitmask", "sparse-bitmask", "marlin-24"])
def test_compressed_sparse_storage_is_refused_at_start_naming_it(fmt: str) -> None:
    groups = {"group_0": {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}
    qc: dict[str, Any] = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups}
    with pytest.raises(ValueError, match=f"sparse weights \\(format '{fmt}'\\)"):
        resolve_quantization(None, {"quantization_config": {**qc, "sparsity_config": {"format": fmt}}})
    dense = {"format": "dense", "sparsity_structure": "unstructured"}
    assert resolve_quantization(None, {"quantization_config": {**qc, "sparsity_config": dense}}) == "fp8"
