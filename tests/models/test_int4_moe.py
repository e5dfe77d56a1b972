"""4-bit MoE checkpoints (GPTQ with and without act order, AWQ) as people download them (Qwen3-30B-A3B-GPTQ-Int4,
Mixtral AWQ): every linear 4-bit, experts included, routers left in full precision. The attention (and dense
MLP) linears run as Int4Linear; the experts are dequantised as they load. Logits equal HF's on the weights
the checkpoint means."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.int4 import Int4Linear, dequantize_experts, repack_experts
from pagedserve.services.engine.models.layers import ROUTER_NAMES
from tests.models.int4_checkpoints import assert_logits_match_hf, awq_tensors, gptq_tensors, rewrite_decoder_linears

pytestmark = pytest.mark.usefixtures("one_thread")
GROUP = 16
PROMPTS = {0: [5, 17, 42, 99, 3, 250, 8], 1: [9, 1, 200]}
MOE_CASES = ["mixtral-moe-top2-renormalized", "qwen2_moe-shared-expert-dense-layer0", "qwen3_moe-qknorm-normtopk"]


def _write_4bit(case: str, model_dir: Path, fmt: str, act_order: bool, group: int = GROUP) -> PreTrainedModel:
    """The case's checkpoint with its decoder linears (experts too, per expert as checkpoints store them; not
    routers) rewritten as 4-bit tensors; returns HF's model loaded from the weights they mean (the oracle).
    GPTQ without act order still writes each linear's plain g_idx, as AutoGPTQ does. `group` 0: GPTQ per output
    channel (group_size -1 in the config)."""

    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        w = weight.t().contiguous().float()  # [out, in] -> the formats' [in, out]
        if fmt == "awq":
            packed, meant_w = awq_tensors(w, GROUP)
        else:
            packed, meant_w = gptq_tensors(w, group or len(w), act_order, seed=len(w))
            packed.setdefault("g_idx", (torch.arange(len(w)) // (group or len(w))).to(torch.int32))
        return packed, meant_w.t().contiguous()

    settings = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}
        if fmt == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": group or -1, "desc_act": act_order, "sym": False}
    )
    return rewrite_decoder_linears(case, model_dir, convert, settings)


@pytest.mark.parametrize(("fmt", "act_order"), [("gptq", False), ("gptq", True), ("awq", False)])
@pytest.mark.parametrize("case", MOE_CASES)
def test_4bit_moe_checkpoint_matches_hf_on_its_weights(case: str, fmt: str, act_order: bool, tmp_path: Path) -> None:
    hf = _write_4bit(case, tmp_path, fmt, act_order)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    int4 = [name for name, m in ours.named_modules() if isinstance(m, Int4Linear)]
    assert any("self_attn" in n for n in int4) and not any(n.rpartition(".")[2] in ROUTER_NAMES for n in int4)
    assert_logits_match_hf(ours, hf, PROMPTS)


def test_an_expert_missing_a_tensor_is_named(tmp_path: Path) -> None:
    _write_4bit(MOE_CASES[2], tmp_path, "gptq", True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.g_idx"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"4-bit experts lack tensors: .*experts\.3\.up_proj': \['g_idx'\]"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)


def test_expert_rows_in_act_order_under_desc_act_false_are_refused(tmp_path: Path) -> None:
    """A checkpoint whose experts' g_idx reorders rows while its config says desc_act: false would load as
    wrong weights if the g_idx were dropped; it fails naming the tensor, before or after the packed parts."""
    _write_4bit(MOE_CASES[2], tmp_path, "gptq", True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"experts\.\d+\.\w+_proj\.g_idx: rows in act order, but the config's desc_act"
    ):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    linear = "model.layers.1.mlp.experts.3.up_proj"
    late = [(f"{linear}.{part}", tensors[f"{linear}.{part}"]) for part in ("qweight", "qzeros", "scales", "g_idx")]
    for stream in (dequantize_experts(late, "gptq", GROUP, 0, False), repack_experts(late, "gptq", GROUP, 0)):
        with pytest.raises(ValueError, match=rf"{linear}\.g_idx: rows in act order"):
            list(stream)


@pytest.mark.parametrize("quantized_experts", [False, True], ids=["dequantised", "packed"])
def test_per_channel_gptq_loads_and_matches_hf(quantized_experts: bool, tmp_path: Path) -> None:
    """GPTQ's group_size -1 (one scale and zero per output channel), attention and experts."""
    hf = _write_4bit(MOE_CASES[2], tmp_path, "gptq", False, group=0)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantized_experts=quantized_experts)
    assert any(isinstance(m, Int4Linear) and m.group_size == m.in_features for m in ours.modules())
    assert_logits_match_hf(ours, hf, PROMPTS)
