"""Quantized checkpoints as they are downloaded, beyond Llama: Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral, Gemma 2/3
(tied embeddings), Phi-3 (fused qkv_proj / gate_up_proj in 4-bit) in AWQ, GPTQ (act order, per channel) and
compressed-tensors W4A16 (asymmetric) and block FP8 (Qwen3-*-FP8's 128x128 `weight_scale_inv`), logits equal to HF
transformers' on the weights the checkpoint means. And what real exports hold beyond the formats' core tensors:
AutoGPTQ's zero biases on bias-free linears, MoE experts an AWQ / GPTQ / compressed-tensors config leaves in full
precision, and tensors or settings that do not match the declared format (another group size in dequantised experts
and a quantized LM head, e5m2 FP8 weights, GPTQModel's other pack dtypes), which fail at start or at load by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.fp8 import FP8_DTYPE
from pagedserve.services.engine.models.fp8_block import dequantize_block_fp8
from pagedserve.services.engine.models.gptq8 import gptq8_format
from pagedserve.services.engine.models.int4 import Int4Linear, dequantize_experts, int4_format
from pagedserve.services.engine.models.quantized_experts import QuantizedExperts, experts_quantization
from tests.models.int4_checkpoints import (
    assert_logits_match_hf,
    awq_tensors,
    gptq_tensors,
    pack_quantized_config,
    pack_quantized_tensors,
    rewrite_decoder_linears,
)

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = {0: [5, 17, 42, 99, 3, 250, 8], 1: [9, 1, 200]}
MOE = "qwen3_moe-qknorm-normtopk"
Convert = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _awq(group: int) -> tuple[Convert, dict[str, Any]]:
    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tensors, meaning = awq_tensors(weight.t().contiguous(), group)
        return tensors, meaning.t().contiguous()

    return convert, {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}


def _gptq(group: int, act_order: bool = False) -> tuple[Convert, dict[str, Any]]:
    """group 0: one group of each linear's inputs (GPTQ's -1). Act order: linears of one input (q/k/v) share a seed."""

    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        k = weight.shape[1]
        tensors, meaning = gptq_tensors(weight.t().contiguous(), group or k, act_order, seed=k)
        return tensors, meaning.t().contiguous()

    settings = {"quant_method": "gptq", "bits": 4, "group_size": group or -1, "desc_act": act_order, "sym": False}
    return convert, settings


def _w4a16(group: int, symmetric: bool) -> tuple[Convert, dict[str, Any]]:
    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return pack_quantized_tensors(weight, group, symmetric)

    config = pack_quantized_config(group, symmetric)
    config["ignore"] = ["lm_head", "re:.*mlp.gate$"]
    return convert, config


def _block_fp8(block: tuple[int, int] = (128, 128)) -> tuple[Convert, dict[str, Any]]:
    """Qwen3-*-FP8: e4m3 weights, a `weight_scale_inv` (a multiplier) per 128x128 block, cut at the edges."""

    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows, cols = -(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])
        scales = torch.stack(
            [
                torch.stack([piece.abs().amax() / 448.0 for piece in band.split(block[1], dim=1)])
                for band in weight.split(block[0], dim=0)
            ]
        ).reshape(rows, cols)
        expanded = scales.repeat_interleave(block[0], 0)[: weight.shape[0]].repeat_interleave(block[1], 1)
        q = (weight / expanded[:, : weight.shape[1]]).to(FP8_DTYPE)
        return {"weight": q, "weight_scale_inv": scales}, dequantize_block_fp8(q, scales, block)

    settings = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    return convert, settings


FORMATS: dict[str, Callable[[], tuple[Convert, dict[str, Any]]]] = {
    "awq-g32": lambda: _awq(32),
    "gptq-g32-act-order": lambda: _gptq(32, act_order=True),
    "gptq-per-channel": lambda: _gptq(0),
    "w4a16-g16-asym": lambda: _w4a16(16, symmetric=False),
    "fp8-block128": _block_fp8,
}


@pytest.mark.parametrize(
    ("case", "fmt"),
    [
        ("qwen2-qkv-bias-tied", "awq-g32"),
        ("qwen2-qkv-bias-tied", "gptq-g32-act-order"),
        ("qwen3-qknorm-headdim", "fp8-block128"),
        ("qwen3-qknorm-headdim", "w4a16-g16-asym"),
        ("mistral-gqa-window", "gptq-per-channel"),
        ("gemma2-window8-softcaps", "gptq-g32-act-order"),
        ("gemma3-window8-qknorm-local-rope", "awq-g32"),
        ("phi3-fused-partial-rotary", "awq-g32"),
        ("phi3-fused-partial-rotary", "gptq-g32-act-order"),
    ],
)
def test_family_checkpoints_match_hf(case: str, fmt: str, tmp_path: Path) -> None:
    convert, settings = FORMATS[fmt]()
    hf = rewrite_decoder_linears(case, tmp_path / "model", convert, settings)
    ours = load_model(tmp_path / "model", dtype="float32", device="cpu", show_progress=False)
    if fmt != "fp8-block128":
        assert sum(isinstance(m, Int4Linear) for m in ours.modules()) == 4 * hf.config.num_hidden_layers
    assert_logits_match_hf(ours, hf, PROMPTS)


def _with_biases(convert: Convert, bias: Callable[[int], torch.Tensor]) -> Convert:
    """AutoGPTQ before 0.5 built every quantized linear with a bias and saved it (zeros where the model has none)."""

    def with_bias(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tensors, meaning = convert(name, weight)
        return {**tensors, "bias": bias(weight.shape[0])}, meaning

    return with_bias


@pytest.mark.parametrize("case", ["llama-gqa-tied-llama3rope-sharded", MOE])
def test_autogptq_zero_biases_of_bias_free_linears_are_skipped(case: str, tmp_path: Path) -> None:
    """TheBloke-era GPTQ checkpoints hold `<linear>.bias` zeros for linears without a bias (experts too): they load,
    as vLLM loads them; a non-zero one would change the outputs, so it stays an error naming it."""
    convert, settings = _gptq(32)
    hf = rewrite_decoder_linears(case, tmp_path / "zeros", _with_biases(convert, torch.zeros), settings)
    ours = load_model(tmp_path / "zeros", dtype="float32", device="cpu", show_progress=False)
    assert_logits_match_hf(ours, hf, PROMPTS)
    if case == MOE:
        return
    rewrite_decoder_linears(case, tmp_path / "ones", _with_biases(convert, torch.ones), settings)
    with pytest.raises(KeyError, match=r"down_proj\.bias"):
        load_model(tmp_path / "ones", dtype="float32", device="cpu", show_progress=False)


def _full_precision_where(convert: Convert, fragment: str) -> Convert:
    """`convert`, except that linears whose name holds `fragment` keep their plain weight."""

    def partly(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if fragment in name:
            return {"weight": weight.contiguous()}, weight
        return convert(name, weight)

    return partly


SKIP_LAYER0_EXPERTS: dict[str, tuple[Callable[[], tuple[Convert, dict[str, Any]]], dict[str, Any]]] = {
    # AWQ exports (QuantTrio's MoE models) skip whole layers by name prefix
    "awq": (lambda: _awq(16), {"modules_to_not_convert": ["model.layers.0."]}),
    # GPTQModel: a "-:" dynamic rule names modules it did not quantize
    "gptq": (lambda: _gptq(16), {"dynamic": {r"-:model\.layers\.0\.mlp\.experts\..*": {}}}),
    "compressed-tensors": (
        lambda: _w4a16(16, symmetric=True),
        {"ignore": ["lm_head", "re:.*mlp.gate$", r"re:model\.layers\.0\.mlp\.experts\..*"]},
    ),
}


@pytest.mark.parametrize("method", list(SKIP_LAYER0_EXPERTS))
def test_moe_with_experts_left_in_full_precision_loads_them_dense(method: str, tmp_path: Path) -> None:
    """A 4-bit MoE checkpoint whose config leaves some experts unquantized: their plain weights cannot fill the
    int4 expert layout (CUDA's default), so every expert is held dequantised; forcing 4-bit experts is refused."""
    make, overrides = SKIP_LAYER0_EXPERTS[method]
    convert, settings = make()
    if method == "awq":  # the layer's attention is skipped too
        convert = _full_precision_where(convert, ".layers.0.")
    settings = {**settings, **overrides}
    hf = rewrite_decoder_linears(MOE, tmp_path, _full_precision_where(convert, ".layers.0.mlp.experts."), settings)
    cfg = {**hf.config.to_dict(), "quantization_config": settings}
    assert experts_quantization(method, cfg, torch.device("cuda"), None) is None
    with pytest.raises(ValueError, match=r"leaves model\.layers\.0\.mlp\.experts\.0\.gate_proj unquantized"):
        experts_quantization(method, cfg, torch.device("cuda"), True)
    if method != "awq":
        return  # the load is the same for every method once the experts are dense
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    assert not any(isinstance(m, QuantizedExperts) for m in ours.modules())
    assert_logits_match_hf(ours, hf, PROMPTS)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("linear", ["model.layers.0.mlp.experts.0.down_proj", "lm_head"])
def test_dequantised_experts_and_head_of_another_group_size_are_refused(fmt: str, linear: str) -> None:
    """Scales and zeros of groups of 16 under a config of 32 still index (the wrong groups): refused by name."""
    weight = torch.randn(64, 32)
    tensors, meaning = gptq_tensors(weight, 16) if fmt == "gptq" else awq_tensors(weight, 16)
    stream = [(f"{linear}.{part}", tensor) for part, tensor in tensors.items()]
    offset = 1 if fmt == "gptq" else 0
    loaded = dict(dequantize_experts(stream, fmt, 16, offset, act_order=False))
    torch.testing.assert_close(loaded[f"{linear}.weight"], meaning.t(), rtol=0, atol=0)
    for group in (32, 0):
        with pytest.raises(ValueError, match=rf"{linear}: its 4-bit tensors do not fit the config's group size"):
            dict(dequantize_experts(stream, fmt, group, offset, act_order=False))


def test_fp8_weights_in_e5m2_are_refused_by_name(tmp_path: Path) -> None:
    """`fmt: e5m2` weights carry scales for e5m2's range: read as e4m3 they would load as garbage."""

    def e5m2(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        scale = weight.abs().amax().float() / 57344.0
        q = (weight / scale).to(torch.float8_e5m2)
        return {"weight": q, "weight_scale": scale.reshape(())}, q.float() * scale

    settings = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e5m2"}
    rewrite_decoder_linears("qwen2-qkv-bias-tied", tmp_path, e5m2, settings)
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.\S+\.weight: torch\.float8_e5m2 weights"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)


GPTQ4 = {"quant_method": "gptq", "bits": 4, "group_size": 128}
OTHER_PACKINGS = {  # settings that keep the 4-bit tensors' names (often their shapes too) with other layouts
    "gptqmodel-pack-dtype-int16": ({**GPTQ4, "pack_dtype": "int16"}, "pack_dtype 'int16' is not supported"),
    "gptq8-pack-dtype-int64": ({**GPTQ4, "bits": 8, "pack_dtype": "int64"}, "pack_dtype 'int64' is not supported"),
    "autogptq-is-marlin-format": ({**GPTQ4, "is_marlin_format": True}, "checkpoint_format 'marlin' is not supported"),
    "llm-awq-backend": (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "backend": "llm-awq"},
        "AWQ backend 'llm-awq' is not supported",
    ),
}


@pytest.mark.parametrize("packing", list(OTHER_PACKINGS))
def test_other_packings_are_refused_at_start(packing: str) -> None:
    qc, message = OTHER_PACKINGS[packing]
    read = gptq8_format if qc.get("bits") == 8 else int4_format
    with pytest.raises(ValueError, match=message):
        read({"quantization_config": qc})
    plain = {k: v for k, v in qc.items() if k not in ("pack_dtype", "is_marlin_format", "backend")}
    assert read({"quantization_config": {**plain, "pack_dtype": "int32", "is_marlin_format": False}}) is not None
    if qc["quant_method"] == "awq":
        assert read({"quantization_config": {**plain, "backend": "AutoAWQ"}}) is not None
