"""Block-wise FP8 checkpoints (Qwen3-*-FP8 / DeepSeek-V3's `weight_block_size` with `weight_scale_inv`, and
compressed-tensors' `strategy: "block"` with `weight_scale`): every decoder linear (experts per expert, routers
left as they are) in e4m3 with one scale per block, blocks that do not divide the weight included. Logits equal
HF's on the weights the checkpoint means (dequantised exactly at load); bad tensors are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.fp8 import FP8_DTYPE
from pagedserve.services.engine.models.fp8_block import dequantize_block_fp8
from tests.models.int4_checkpoints import assert_logits_match_hf, rewrite_decoder_linears

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = (16, 24)  # 24 does not divide the tiny models' 64 inputs: the last column block is cut
PROMPTS = {0: [5, 17, 42, 99, 3, 250, 8], 1: [9, 1, 200]}
SPELLINGS = {  # quantization_config, the scale's name
    "fp8": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)},
        "weight_scale_inv",
    ),
    "compressed-tensors": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": list(BLOCK)},
                    "input_activations": {"type": "float", "num_bits": 8, "strategy": "group", "dynamic": True},
                }
            },
            "ignore": ["lm_head"],
        },
        "weight_scale",
    ),
}


def block_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]): each block's amax maps to 448."""
    (rows, cols), (bn, bk) = weight.shape, BLOCK
    scales = torch.empty(-(-rows // bn), -(-cols // bk))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            scales[i, j] = block.abs().amax().clamp(min=1e-12) / 448.0
    expanded = scales.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
    return (weight.float() / expanded).clamp(-448, 448).to(FP8_DTYPE), scales


def write_block_fp8(case: str, model_dir: Path, spelling: str) -> PreTrainedModel:
    """The case's checkpoint in block FP8; returns HF's model on the weights it means (the oracle)."""
    config_entry, scale_name = SPELLINGS[spelling]

    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, scales = block_quantize(weight)
        tensors = {"weight": q, scale_name: scales, "input_scale": torch.ones(())}
        return tensors, dequantize_block_fp8(q, scales, BLOCK)

    return rewrite_decoder_linears(case, model_dir, convert, config_entry)


def test_block_dequantization_by_hand() -> None:
    """A 3x5 weight in blocks of 2x3: four scales, the last row and column blocks cut."""
    q = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]], dtype=torch.float32).to(FP8_DTYPE)
    scales = torch.tensor([[0.5, 2.0], [4.0, 0.25]])
    want = torch.tensor(
        [[0.5, 1.0, 1.5, 8.0, 10.0], [3.0, 3.5, 4.0, 18.0, 20.0], [44.0, 48.0, 52.0, 3.5, 3.75]], dtype=torch.float32
    )
    torch.testing.assert_close(dequantize_block_fp8(q, scales, (2, 3)), want, rtol=0, atol=0)


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("case", ["llama-gqa-tied-llama3rope-sharded", "qwen3_moe-qknorm-normtopk"])
def test_block_fp8_checkpoint_matches_hf_on_its_weights(case: str, spelling: str, tmp_path: Path) -> None:
    hf = write_block_fp8(case, tmp_path, spelling)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    assert_logits_match_hf(ours, hf, PROMPTS)
    # vLLM users pass --quantization fp8 for these checkpoints: it names their method
    load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantization="fp8")


def test_bad_block_scales_are_named(tmp_path: Path) -> None:
    write_block_fp8("llama-gqa-tied-llama3rope-sharded", tmp_path, "fp8")
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    linear = "model.layers.1.mlp.down_proj"
    tensors[f"{linear}.weight_scale_inv"] = tensors[f"{linear}.weight_scale_inv"][:, :1].contiguous()
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=rf"{linear}\.weight_scale_inv: shape \(4, 1\), expected \(4, 6\)"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    del tensors[f"{linear}.weight_scale_inv"]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=rf"block fp8 linears lack tensors: .*{linear}': \['weight_scale_inv'\]"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"weight_block_size \[128\] is not two positive block sizes"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
