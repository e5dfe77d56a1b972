"""A 4-bit AWQ / GPTQ checkpoint of a tiny Llama loads and computes what HF transformers computes with
the weights the checkpoint means (the oracle: the HF model with each linear set to its dequantized W)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.int4 import Int4Linear
from tests.models.int4_checkpoints import assert_logits_match_hf, awq_tensors, gptq_tensors, write_quantized_llama
from tests.models.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = {0: [5, 17, 42, 99, 3, 250, 8], 1: [9, 1, 200]}
GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize_checkpoint(model_dir: Path, fmt: str, act_order: bool) -> torch.nn.Module:
    """Rewrite the saved model's decoder linears as 4-bit tensors; returns HF's model with the meant weights."""
    hf = build_tiny_model("llama-gqa-tied-llama3rope-sharded", model_dir)
    for path in [*model_dir.glob("*.safetensors"), *model_dir.glob("*.safetensors.index.json")]:
        path.unlink()
    state, quantized = hf.state_dict(), {}
    for name, weight in state.items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue  # tied: the checkpoint holds the embedding once
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEARS:
            quantized[name] = weight.contiguous()
            continue
        w = weight.t().contiguous()  # HF's [out, in] -> the formats' [in, out]
        # Linears that read the same input (q/k/v, gate/up) share GPTQ's act-order permutation: seed by input size.
        tensors, meaning = awq_tensors(w, GROUP) if fmt == "awq" else gptq_tensors(w, GROUP, act_order, seed=len(w))
        base = name.removesuffix(".weight")
        quantized.update({f"{base}.{key}": value for key, value in tensors.items()})
        with torch.no_grad():
            hf.get_parameter(name).copy_(meaning.t())
    save_file(quantized, str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}
        if fmt == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": False}
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    return hf


@pytest.mark.parametrize(("fmt", "act_order"), [("awq", False), ("gptq", False), ("gptq", True)])
def test_quantized_checkpoint_matches_hf_on_its_weights(tmp_path: Path, fmt: str, act_order: bool) -> None:
    hf = _quantize_checkpoint(tmp_path, fmt, act_order)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    assert sum(isinstance(m, Int4Linear) for m in ours.modules()) == 2 * 4  # qkv, o, gate_up, down per layer
    assert_logits_match_hf(ours, hf, PROMPTS)


def test_quantization_flag_must_name_the_checkpoints_method(tmp_path: Path) -> None:
    _quantize_checkpoint(tmp_path, "gptq", False)
    with pytest.raises(ValueError, match="quantization 'awq': the checkpoint's weights are 'gptq'"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantization="awq")
    load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantization="gptq")


@pytest.mark.parametrize(
    ("fmt", "skips", "full", "num_int4"),
    [
        # AutoAWQ / transformers: modules whose name contains an entry stay full precision (both down_proj, and
        # layer 0's fused qkv and o)
        (
            "awq",
            {"modules_to_not_convert": ["down_proj", "layers.0.self_attn"]},
            ("down_proj", "layers.0.self_attn"),
            4,
        ),
        # GPTQModel: a "-:" dynamic rule's regex names modules it skipped (layer 1's fused gate_up)
        (
            "gptq",
            {"dynamic": {r"-:.*\.layers\.1\.mlp\.(gate|up)_proj": {}}},
            ("layers.1.mlp.gate", "layers.1.mlp.up"),
            7,
        ),
    ],
)
def test_linears_the_checkpoint_left_in_full_precision(
    tmp_path: Path, fmt: str, skips: dict[str, object], full: tuple[str, ...], num_int4: int
) -> None:
    def quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = weight.t().contiguous()
        tensors, meaning = awq_tensors(w, GROUP) if fmt == "awq" else gptq_tensors(w, GROUP, False, seed=len(w))
        return tensors, meaning.t()

    settings = {"quant_method": fmt, "bits": 4, "group_size": GROUP, **skips}
    settings |= {"version": "gemm", "zero_point": True} if fmt == "awq" else {"desc_act": False, "sym": False}
    hf = write_quantized_llama(tmp_path, quantize, settings, keep_full=lambda name: any(f in name for f in full))
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    assert sum(isinstance(m, Int4Linear) for m in ours.modules()) == num_int4  # of 2 layers x (qkv, o, gate_up, down)
    assert_logits_match_hf(ours, hf, PROMPTS)


def test_gptqmodel_per_module_overrides_are_refused(tmp_path: Path) -> None:
    _quantize_checkpoint(tmp_path, "gptq", False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {r"+:.*down_proj": {"bits": 8}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPTQModel's per-module overrides .*not supported"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
