"""MoE experts kept quantized in memory (models/quantized_experts.py): which layout the loader picks, tiny
GPTQ / AWQ / compressed-tensors / FP8 Qwen3-MoE and Mixtral checkpoints loaded the way CUDA loads them
(`quantized_experts=True`, here on CPU): the expert tensors stay uint8 / float8 in the kernel's layouts, mean
exactly the checkpoint's weights, and the logits equal HF's on those weights (the torch path dequantises per
expert); the fused-MoE kernel (interpreted) on a loaded layer equals the torch path. The same on a GPU when
there is one (the kernel compiled)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from pagedserve.kernels import expert_quant
from pagedserve.kernels.moe_reference import experts_grouped
from pagedserve.services.engine.models import CausalLM, load_model
from pagedserve.services.engine.models.moe import MoE, route
from pagedserve.services.engine.models.quantized_experts import (
    Fp8Experts,
    Int4Experts,
    QuantizedExperts,
    experts_quantization,
)
from tests.models.int4_checkpoints import (
    assert_logits_match_hf,
    pack_quantized_config,
    pack_quantized_tensors,
    rewrite_decoder_linears,
)
from tests.models.paged_driver import PagedDriver
from tests.models.test_int4_moe import PROMPTS, _write_4bit
from tests.models.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = ["qwen3_moe-qknorm-normtopk", "mixtral-moe-top2-renormalized"]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
# The fused-MoE kernel runs compiled where CUDA is, else under the interpreter (conftest).
KERNEL_DEVICE = CUDA if torch.cuda.is_available() else CPU


def test_the_loader_keeps_experts_quantized_on_cuda_only() -> None:
    gptq = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False}}
    act_order = {"quantization_config": {**gptq["quantization_config"], "desc_act": True}}
    awq = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}}
    ct = {"quantization_config": pack_quantized_config(0, True)}
    assert experts_quantization("fp8", {}, CUDA, None) == {"format": "fp8"}
    assert experts_quantization("fp8", {}, CPU, None) is None  # the torch paths run dense weights faster
    assert experts_quantization("fp8", {}, CPU, True) == {"format": "fp8"}
    assert experts_quantization("fp8", {}, CUDA, False) is None
    assert experts_quantization("gptq", gptq, CUDA, None) == {"format": "int4", "group_size": 64}
    assert experts_quantization("awq", awq, CUDA, None) == {"format": "int4", "group_size": 32}
    assert experts_quantization("compressed-tensors", ct, CUDA, None) == {"format": "int4", "group_size": 0}
    assert experts_quantization("gptq", act_order, CUDA, None) is None  # act order: dequantised at load
    with pytest.raises(ValueError, match="act-order"):
        experts_quantization("gptq", act_order, CPU, True)
    ct_act_order = {"quantization_config": pack_quantized_config(32, True, act_order=True)}
    assert experts_quantization("compressed-tensors", ct_act_order, CUDA, None) is None
    assert experts_quantization("none", {}, CUDA, None) is None
    assert experts_quantization("mxfp4", {}, CUDA, None) is None  # gpt-oss's own (mxfp4.keeps_experts_packed)


def _experts(model: CausalLM) -> list[QuantizedExperts]:
    return [m for m in model.modules() if isinstance(m, QuantizedExperts)]


def _hf_logits_match(ours: CausalLM, hf: PreTrainedModel, atol: float = 1e-4) -> None:
    assert_logits_match_hf(ours, hf, PROMPTS, atol)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
@pytest.mark.parametrize("case", CASES)
def test_4bit_experts_stay_packed_and_match_hf(case: str, fmt: str, tmp_path: Path) -> None:
    hf = _write_4bit(case, tmp_path, fmt, act_order=False)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantized_experts=True)
    experts = _experts(ours)
    assert experts and all(isinstance(e, Int4Experts) for e in experts)
    for e in experts:
        assert e.gate_up_proj.dtype == e.down_proj.dtype == e.gate_up_proj_zeros.dtype == torch.uint8
        assert e.gate_up_proj.shape[-1] * 2 == hf.config.hidden_size  # two codes a byte: 4 bits a weight
    _check_meant_experts(ours, hf)
    _hf_logits_match(ours, hf)
    _check_kernel_on_a_layer(ours)


def _check_meant_experts(ours: CausalLM, hf: PreTrainedModel) -> None:
    """Each loaded expert, dequantised, is exactly HF's (meant) expert weight (transformers' in-memory experts
    are our [E, 2I, hidden] / [E, hidden, I])."""
    hf_params = dict(hf.named_parameters())
    for name, module in ours.named_modules():
        if isinstance(module, QuantizedExperts):
            for weight in ("gate_up_proj", "down_proj"):
                w, scale, zeros = (getattr(module, f"{weight}{s}", None) for s in ("", "_scale", "_zeros"))
                got = expert_quant.dequantize(w, scale, zeros, torch.float32)
                torch.testing.assert_close(got, hf_params[f"{name}.{weight}"], atol=0, rtol=0, msg=name)


def _check_kernel_on_a_layer(ours: CausalLM) -> None:
    """The fused-MoE kernel (interpreted on CPU, compiled where CUDA is) on a loaded layer's quantized experts
    equals the torch path, which dequantises per expert. In float32 to 1e-4; in bf16 the two round at different
    points, so each is measured against the float32 torch path on the same codes and the kernel may err at
    most twice as much as the bf16 torch path."""
    pytest.importorskip("triton")
    from pagedserve.kernels import fused_moe

    moe = next(m for m in ours.modules() if isinstance(m, MoE))
    experts = moe.experts
    assert isinstance(experts, QuantizedExperts)
    gate = moe.gate.weight
    x = torch.randn(5, gate.shape[1], device=gate.device, dtype=gate.dtype)
    weights, ids = route(moe.gate(x), moe.top_k, moe.scoring, moe.renormalize)
    x, weights, ids = (t.to(KERNEL_DEVICE) for t in (x, weights, ids))
    w13, w2 = experts.gate_up_proj.to(KERNEL_DEVICE), experts.down_proj.to(KERNEL_DEVICE)
    quant = {k: None if v is None else v.to(KERNEL_DEVICE) for k, v in experts._quant().items()}
    got = fused_moe.fused_experts(x, w13, w2, weights, ids, **quant)
    want = experts_grouped(x, w13, w2, weights, ids, **quant)
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        return
    exact = experts_grouped(x.float(), w13, w2, weights, ids, **quant)
    kernel_error = float((got.float() - exact).abs().max())
    torch_error = float((want.float() - exact).abs().max())
    assert kernel_error <= 2 * torch_error + 1e-3 * float(exact.abs().max()), (kernel_error, torch_error)


def _write_compressed_tensors(case: str, model_dir: Path, group_size: int, symmetric: bool) -> PreTrainedModel:
    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return pack_quantized_tensors(weight, group_size, symmetric)

    config = pack_quantized_config(group_size, symmetric)
    config["ignore"] = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]  # routers, as llm-compressor
    return rewrite_decoder_linears(case, model_dir, convert, config)


@pytest.mark.parametrize("quantized", [True, False], ids=["packed", "dequantised"])
@pytest.mark.parametrize(("group_size", "symmetric"), [(16, True), (0, False)], ids=["g16-sym", "channel-asym"])
def test_compressed_tensors_moe_loads_and_matches_hf(
    group_size: int, symmetric: bool, quantized: bool, tmp_path: Path
) -> None:
    """compressed-tensors MoE checkpoints (llm-compressor's W4A16 Qwen3-MoE): experts packed, or dequantised."""
    hf = _write_compressed_tensors(CASES[0], tmp_path, group_size, symmetric)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantized_experts=quantized)
    assert bool(_experts(ours)) == quantized
    if quantized:
        _check_meant_experts(ours, hf)
    _hf_logits_match(ours, hf)


def _write_fp8(case: str, model_dir: Path, per_tensor: bool) -> PreTrainedModel:
    """Every decoder linear and expert as fp8 with a [N, 1] scale, or experts with one scalar scale each
    (`per_tensor`, as FP8 checkpoints of the per-tensor scheme hold)."""

    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if per_tensor and ".experts." in name:
            scale = weight.abs().amax().float() / 448.0
            q = (weight / scale).to(expert_quant.FP8_DTYPE)
            return {"weight": q, "weight_scale": scale.reshape(())}, q.float() * scale
        q, s = expert_quant.quantize_fp8(weight)
        return {"weight": q, "weight_scale": s[:, None]}, q.float() * s[:, None]

    return rewrite_decoder_linears(case, model_dir, convert, {"quant_method": "fp8", "activation_scheme": "dynamic"})


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
@pytest.mark.parametrize("case", CASES)
def test_fp8_experts_stay_fp8_and_equal_the_dequantised_load(case: str, per_tensor: bool, tmp_path: Path) -> None:
    """The fp8 experts mean exactly the checkpoint's weights; the model equals the same checkpoint with its experts
    dequantised at load (the attention linears are Fp8Linear in both)."""
    hf = _write_fp8(case, tmp_path / "fp8", per_tensor)
    kwargs = dict(dtype="float32", device="cpu", show_progress=False)
    ours = load_model(tmp_path / "fp8", quantized_experts=True, **kwargs)
    dense = load_model(tmp_path / "fp8", quantized_experts=False, **kwargs)
    experts = _experts(ours)
    assert experts and all(isinstance(e, Fp8Experts) for e in experts) and not _experts(dense)
    for e in experts:
        assert e.gate_up_proj.dtype == e.down_proj.dtype == expert_quant.FP8_DTYPE
    _check_meant_experts(ours, hf)
    want = PagedDriver(dense).step(PROMPTS)
    for got_i, want_i in zip(PagedDriver(ours).step(PROMPTS), want, strict=True):
        torch.testing.assert_close(got_i, want_i, atol=1e-5, rtol=1e-5)
    _check_kernel_on_a_layer(ours)


def test_online_fp8_quantizes_moe_experts(tmp_path: Path) -> None:
    """`--quantization fp8` on a full-precision MoE checkpoint: experts fp8 per output channel as they load."""
    build_tiny_model(CASES[0], tmp_path)
    full = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    fp8 = load_model(
        tmp_path, dtype="float32", device="cpu", show_progress=False, quantization="fp8", quantized_experts=True
    )
    experts = _experts(fp8)
    assert experts and all(e.gate_up_proj.dtype == expert_quant.FP8_DTYPE for e in experts)
    for name, module in fp8.named_modules():
        if isinstance(module, Fp8Experts):
            for weight in ("gate_up_proj", "down_proj"):
                got = expert_quant.dequantize(
                    getattr(module, weight), getattr(module, f"{weight}_scale"), None, torch.float32
                )
                want = full.get_parameter(f"{name}.{weight}")
                assert float(((got - want).abs() / want.abs().amax(-1, keepdim=True)).max()) <= 2**-4, name
    _check_kernel_on_a_layer(fp8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["gptq", "awq", "fp8"])
def test_on_cuda_experts_stay_quantized_and_match(fmt: str, tmp_path: Path) -> None:
    """bf16 on a GPU, by default (no flag): quantized experts through the compiled kernel, near the same
    checkpoint with its experts dequantised at load."""
    if fmt == "fp8":
        _write_fp8(CASES[0], tmp_path, per_tensor=False)
    else:
        _write_4bit(CASES[0], tmp_path, fmt, act_order=False)
    ours = load_model(tmp_path, dtype="bfloat16", device="cuda", show_progress=False)
    dense = load_model(tmp_path, dtype="bfloat16", device="cuda", show_progress=False, quantized_experts=False)
    experts = _experts(ours)
    assert experts and not _experts(dense)
    assert all(e.gate_up_proj.dtype in (torch.uint8, expert_quant.FP8_DTYPE) for e in experts)
    for got, want in zip(
        PagedDriver(ours, block_size=16).step(PROMPTS), PagedDriver(dense, block_size=16).step(PROMPTS), strict=True
    ):
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert rel < 2e-2, rel
    _check_kernel_on_a_layer(ours)
