"""GPT-NeoX's and Falcon's fused per-head `query_key_value` in quantized checkpoints: 4-bit GPTQ, AWQ and
compressed-tensors W4A16 (kept 4-bit) and per-tensor FP8. Each tensor's outputs are reordered along its own
output dimension (models/fused_qkv.py); the logits match HF transformers on the weights the checkpoint means."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.fp8 import FP8_DTYPE, Fp8Linear
from pagedserve.services.engine.models.fused_qkv import int4_packing, reorder_outputs
from pagedserve.services.engine.models.gpt_neox import per_head_qkv_to_stacked
from pagedserve.services.engine.models.int4 import AWQ_ORDER, Int4Linear, unpack_columns
from pagedserve.services.engine.models.int4_repack import pack_columns
from tests.models.int4_checkpoints import (
    assert_logits_match_hf,
    awq_tensors,
    gptq_tensors,
    pack_quantized_config,
    pack_quantized_tensors,
)
from tests.models.paged_driver import PagedDriver
from tests.models.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = {0: [5, 17, 42, 99, 3, 250, 8], 1: [9, 1, 200]}
GROUP = 32
CASES = (
    "gpt_neox-parallel-partial-rotary",  # per-head [head][q, k, v], rotary_pct 0.25
    "falcon-new-decoder-gqa",  # [kv group][q.., k, v], 2 kv heads
    "falcon-multi-query-parallel",  # already [q | k | v]
    "falcon-per-head-sequential-bias",  # per-head, with a qkv bias
)
_DECODER_LAYER = re.compile(r"\.(layers|h)\.\d+\.")  # GPT-NeoX's gpt_neox.layers.N, Falcon's transformer.h.N

Convert = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]  # HF [N, K] -> (tensors, meant)


def _gptq(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    k = weight.shape[1]
    tensors, meant = gptq_tensors(weight.t().contiguous(), GROUP, act_order=True, seed=k)  # same g_idx per K
    return tensors, meant.t().contiguous()


def _awq(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    tensors, meant = awq_tensors(weight.t().contiguous(), GROUP)
    return tensors, meant.t().contiguous()


def _w4a16(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return pack_quantized_tensors(weight, 16, symmetric=False)  # zero points packed along the outputs


def _fp8_tensor(scale_shape: tuple[int, ...]) -> Convert:
    def convert(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        scale = (weight.abs().amax().float() / 448.0).reshape(scale_shape)
        q = (weight / scale).to(FP8_DTYPE)
        return {"weight": q, "weight_scale": scale, "input_scale": torch.full(scale_shape, 0.02)}, q.float() * scale

    return convert


_CT_FP8: dict[str, object] = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "tensor",
                "dynamic": False,
            },
        }
    },
    "ignore": ["lm_head"],
}
INT4_FORMATS: dict[str, tuple[Convert, dict[str, object]]] = {
    "gptq-act-order": (_gptq, {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False}),
    "awq": (_awq, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}),
    "ct-w4a16": (_w4a16, pack_quantized_config(16, symmetric=False)),
}
FP8_FORMATS: dict[str, tuple[Convert, dict[str, object]]] = {
    "fp8-scalar-scale": (_fp8_tensor(()), {"quant_method": "fp8", "activation_scheme": "static"}),
    "ct-fp8-tensor": (_fp8_tensor((1,)), _CT_FP8),
}


def _write_checkpoint(case: str, model_dir: Path, convert: Convert, qc: dict[str, object]) -> PreTrainedModel:
    """The case's checkpoint with every decoder linear replaced by `convert`'s tensors; returns HF's model on the
    weights they mean (the oracle)."""
    source, meant = model_dir / "source", model_dir / "meant"
    build_tiny_model(case, source)
    meant.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    written, meaning = {}, {}
    for name, weight in tensors.items():
        if not (_DECODER_LAYER.search(name) and name.endswith(".weight") and weight.dim() == 2):
            written[name] = meaning[name] = weight.contiguous()
            continue
        packed, meaning[name] = convert(weight)
        written.update({f"{name.removesuffix('.weight')}.{key}": value for key, value in packed.items()})
    config = json.loads((source / "config.json").read_text())
    for directory, state, cfg in (
        (model_dir, written, {**config, "quantization_config": qc}),
        (meant, meaning, config),
    ):
        save_file(state, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(cfg))
    return AutoModelForCausalLM.from_pretrained(meant, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("fmt", list(INT4_FORMATS))
@pytest.mark.parametrize("case", CASES)
def test_int4_fused_qkv_matches_hf(case: str, fmt: str, tmp_path: Path) -> None:
    convert, qc = INT4_FORMATS[fmt]
    hf = _write_checkpoint(case, tmp_path, convert, qc)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    assert isinstance(ours.get_submodule("model.layers.0.self_attn.qkv_proj"), Int4Linear)
    assert_logits_match_hf(ours, hf, PROMPTS)


@pytest.mark.parametrize("fmt", list(FP8_FORMATS))
@pytest.mark.parametrize("case", CASES)
def test_per_tensor_fp8_fused_qkv_matches_hf(case: str, fmt: str, tmp_path: Path) -> None:
    """The fp8 weights load exactly (each linear's dequantised weight is the full-precision load of the meant
    weights'); the logits stay near HF's (activations are quantised per token: a wrong row order is far off)."""
    convert, qc = FP8_FORMATS[fmt]
    hf = _write_checkpoint(case, tmp_path, convert, qc)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    reference = load_model(tmp_path / "meant", dtype="float32", device="cpu", show_progress=False)
    linears = {name: m for name, m in ours.named_modules() if isinstance(m, Fp8Linear)}
    assert "model.layers.0.self_attn.qkv_proj" in linears
    for name, layer in linears.items():
        got = layer.weight.float() * layer.weight_scale[:, None]
        torch.testing.assert_close(got, reference.get_parameter(f"{name}.weight"), atol=0, rtol=0, msg=name)
    got_logits = PagedDriver(ours).step(PROMPTS)
    for index, prompt in PROMPTS.items():
        with torch.inference_mode():
            want = hf(torch.tensor([prompt])).logits[0]
        assert float((got_logits[index] - want).norm() / want.norm()) < 0.1, index


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    return pack_columns(values.view(values.shape[0], -1, 8)[..., list(AWQ_ORDER)].reshape(values.shape))


@pytest.mark.parametrize("packing", ["gptq", "awq"])
@pytest.mark.parametrize("head_dim", [4, 8])  # 4: packs of eight outputs split across heads (unpack, repack)
def test_packed_columns_follow_the_outputs(packing: str, head_dim: int) -> None:
    num_heads, rows = 4, 6
    values = torch.randint(0, 16, (rows, 3 * num_heads * head_dim), generator=torch.Generator().manual_seed(0))
    packed = _awq_pack(values) if packing == "awq" else pack_columns(values)
    assert torch.equal(unpack_columns(packed, packing), values)

    def reorder(tensor: torch.Tensor) -> torch.Tensor:
        return per_head_qkv_to_stacked(tensor, num_heads)

    want = reorder(values.t()).t()
    assert torch.equal(unpack_columns(reorder_outputs("qzeros", packed, reorder, packing), packing), want)
    if packing == "awq":  # AWQ's qweight is packed along the outputs too
        assert torch.equal(unpack_columns(reorder_outputs("qweight", packed, reorder, packing), "awq"), want)
    else:  # GPTQ's qweight [K/8, N] (and scales [K/G, N]) move their columns
        qweight = torch.randint(-(2**31), 2**31 - 1, values.shape, dtype=torch.int32)  # any int32 [rows, N]
        assert torch.equal(reorder_outputs("qweight", qweight, reorder, packing), reorder(qweight.t()).t())
        scales = values.half()
        assert torch.equal(reorder_outputs("scales", scales, reorder, packing), want.half())
    assert torch.equal(reorder_outputs("g_idx", values[0], reorder, packing), values[0])
    scalar = torch.tensor(0.5)
    assert reorder_outputs("weight_scale", scalar, reorder, packing) is scalar


def test_int4_packing_reads_the_method() -> None:
    assert int4_packing({"quantization_config": {"quant_method": "awq"}}) == "awq"
    assert int4_packing({"quantization_config": {"quant_method": "gptq"}}) == "gptq"
    assert int4_packing({}) == "gptq"
