"""Random weights in quantized layouts (load_format random with a 4-bit config or fp8, as vLLM's dummy format):
each format's parameters get values of their own kind, so the dequantised weights are about N(0, 0.02), the
model computes finite logits, and the same seed gives the same model. Benchmarks load a 70B shape in 4 bits
this way without writing a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from bench.model_shapes import write_model_dir
from pagedserve.kernels import expert_quant
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.models.fp8 import Fp8Linear
from pagedserve.services.engine.models.int4 import Int4Linear
from pagedserve.services.engine.models.int4_repack import can_tile
from pagedserve.services.engine.models.quantized_experts import Fp8Experts, Int4Experts
from tests.models.paged_driver import PagedDriver

WEIGHT_STD = 0.02  # parallel/loading.random_tensor's


def _load(name: str, quantization: str, experts: bool | None = None, seed: int = 0) -> CausalLM:
    model_dir = write_model_dir(name, tiny=True, tokenizer_dir=None, quantization=quantization)
    return load_model(
        model_dir,
        "float32",
        "cpu",
        show_progress=False,
        random_weights_seed=seed,
        quantization="fp8" if quantization == "fp8" else None,
        quantized_experts=experts,
    )


def _logits(model: CausalLM) -> torch.Tensor:
    return torch.cat(PagedDriver(model).step({0: list(range(3, 40))}))


def _of(model: nn.Module, cls: type) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, cls)]


def _assert_weight_like(weight: torch.Tensor) -> None:
    std = weight.float().std().item()
    assert 0.5 * WEIGHT_STD < std < 2 * WEIGHT_STD, std


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_random_int4_linears_dequantise_to_small_weights(method: str) -> None:
    model = _load("llama-3.1-8b", method)
    linears = _of(model, Int4Linear)
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down in each of the tiny shape's 2 layers
    for linear in linears:
        assert isinstance(linear, Int4Linear)  # AWQ repacked like a checkpoint, tiled where the shape allows
        assert linear.packed_fmt == ("tiled" if can_tile(linear.in_features, linear.group_size) else "gptq")
        assert linear.act_order is None and linear.input_perm is None  # g_idx is the plain k // G
        _assert_weight_like(linear.dequantized())
    logits = _logits(model)
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert torch.equal(_logits(_load("llama-3.1-8b", method)), logits)  # same seed, same model


def test_random_fp8_linears_dequantise_to_small_weights() -> None:
    model = _load("llama-3.1-8b", "fp8")
    linears = _of(model, Fp8Linear)
    assert len(linears) == 2 * 4
    for linear in linears:
        assert isinstance(linear, Fp8Linear) and linear.weight.dtype == torch.float8_e4m3fn
        assert (linear.weight_scale > 0).all()
        _assert_weight_like(linear.weight.float() * linear.weight_scale[:, None])
    assert torch.isfinite(_logits(model)).all()


@pytest.mark.parametrize(("method", "cls"), [("gptq", Int4Experts), ("fp8", Fp8Experts)])
def test_random_quantized_experts(method: str, cls: type) -> None:
    model = _load("qwen3-30b-a3b", method, experts=True)
    experts = _of(model, cls)
    assert len(experts) == 2
    for module in experts:
        zeros = getattr(module, "gate_up_proj_zeros", None)
        if zeros is not None:
            assert int(zeros.max()) <= 15  # one 4-bit zero point a byte
        for weight in ("gate_up_proj", "down_proj"):
            dense = expert_quant.dequantize(
                getattr(module, weight),
                getattr(module, f"{weight}_scale"),
                getattr(module, f"{weight}_zeros", None),
                torch.float32,
            )
            _assert_weight_like(dense)
    assert torch.isfinite(_logits(model)).all()


def test_model_dir_declares_the_4bit_format() -> None:
    model_dir = write_model_dir("qwen3-30b-a3b", tiny=True, tokenizer_dir=None, quantization="awq")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization_config"] == dict(
        quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm"
    )
