"""FP8 weights on CPU: quantisation, the scaled matmul, quantise-at-load and pre-quantised checkpoints.

CPU runs the same `torch._scaled_mm` as CUDA where this torch build has it (else a dequantising path),
so these check the logic and the arithmetic; tests/models/test_gpu_models.py covers the GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pagedserve.services.engine.models import CausalLM, load_model
from pagedserve.services.engine.models.fp8 import FP8_DTYPE, Fp8Linear, fp8_linear, quantize_rows
from tests.models.paged_driver import PagedDriver
from tests.models.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
CASE = "llama-gqa-tied-llama3rope-sharded"
_gen = torch.Generator().manual_seed(2)
PROMPTS = [torch.randint(3, 256, (n,), generator=_gen).tolist() for n in (4, 11, 19)]


def test_quantize_rows_error_is_within_e4m3_precision() -> None:
    w = torch.randn((64, 96), generator=_gen) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different scale
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (64,)
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((64,), 448.0))  # each row uses the full range
    deq = q.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; small values are subnormal.
    assert float(((deq - w).abs() / w.abs().amax(dim=1, keepdim=True)).max()) <= 2**-4


def test_fp8_linear_matches_dequantised_operands_and_full_precision() -> None:
    x = torch.randn((9, 128), generator=_gen)
    w = torch.randn((48, 128), generator=_gen) / 10
    bias = torch.randn(48, generator=_gen)
    w_q, w_scale = quantize_rows(w)
    out = fp8_linear(x, w_q, w_scale, bias)
    x_q, x_scale = quantize_rows(x)
    dequantised = F.linear(x_q.float() * x_scale[:, None], w_q.float() * w_scale[:, None], bias)
    torch.testing.assert_close(out, dequantised, atol=1e-4, rtol=1e-4)
    exact = F.linear(x, w, bias)
    assert float((out - exact).norm() / exact.norm()) < 0.06


def _logits(model: CausalLM) -> torch.Tensor:
    return torch.cat(PagedDriver(model).step(dict(enumerate(PROMPTS))))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_quantize_at_load_from_full_precision_checkpoint(tmp_path: Path) -> None:
    build_tiny_model(CASE, tmp_path)
    full = load_model(tmp_path, dtype="fp32", device="cpu", show_progress=False)
    fp8 = load_model(tmp_path, dtype="fp32", device="cpu", show_progress=False, quantization="fp8")
    linears = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer; lm_head/embeddings stay full precision
    assert all(m.weight.dtype == FP8_DTYPE and bool((m.weight_scale > 0).all()) for m in linears)
    qkv = fp8.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, Fp8Linear)
    full_qkv = full.get_submodule("model.layers.0.self_attn.qkv_proj").weight
    torch.testing.assert_close(qkv.weight.float() * qkv.weight_scale[:, None], full_qkv, atol=0, rtol=2**-4)
    # This tiny model's wide init amplifies rounding: bf16 weights alone give ~1% logit error here, and
    # e4m3 keeps 4 fewer mantissa bits (16x), so ~15-20% is the expected size, not a defect.
    err = _relative_error(_logits(fp8), _logits(full))
    assert 0 < err < 0.3, err


def _write_prequantised(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """An HF fp8 checkpoint of the tiny model: per-tensor scales for every layer linear (so fused q/k/v
    load three different scales), a static input_scale, and the dequantised weights it stands for."""
    from safetensors.torch import load_file

    tensors = load_file(str(src / "model.safetensors")) if (src / "model.safetensors").exists() else {}
    if not tensors:
        for shard in sorted(src.glob("*.safetensors")):
            tensors.update(load_file(str(shard)))
    out: dict[str, torch.Tensor] = {}
    dequantised: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            scale = t.abs().max().float() / 448.0
            q = (t / scale).to(FP8_DTYPE)
            out[name], out[name + "_scale"] = q, scale
            out[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
            dequantised[name] = q.float() * scale
        else:
            out[name] = dequantised[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantised


def test_prequantised_fp8_checkpoint_loads_exactly(tmp_path: Path) -> None:
    src, dst = tmp_path / "bf16", tmp_path / "fp8"
    src.mkdir()
    dst.mkdir()
    build_tiny_model(CASE, src)
    dequantised = _write_prequantised(src, dst)
    fp8 = load_model(dst, dtype="fp32", device="cpu", show_progress=False)  # detected from the config
    qkv = fp8.get_submodule("model.layers.1.self_attn.qkv_proj")
    assert isinstance(qkv, Fp8Linear)
    want = torch.cat([dequantised[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(qkv.weight.float() * qkv.weight_scale[:, None], want, atol=0, rtol=0)
    assert len(set(qkv.weight_scale.tolist())) == 3  # q, k and v kept their own scales
    # The same model in fp32 on the dequantised weights: only the activations' fp8 rounding differs.
    reference = load_model(src, dtype="fp32", device="cpu", show_progress=False, tensors=dequantised.items())
    err = _relative_error(_logits(fp8), _logits(reference))
    assert 0 < err < 0.2, err  # ~0.13 on this model: activations rounded to e4m3 per token


def test_unknown_quantization_is_refused(tmp_path: Path) -> None:
    build_tiny_model(CASE, tmp_path)
    with pytest.raises(ValueError, match="quantization"):
        load_model(tmp_path, dtype="fp32", device="cpu", show_progress=False, quantization="int3")
