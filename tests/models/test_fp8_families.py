"""FP8 weights for every family, not only Llama: quantised at load from a full-precision checkpoint
(`--quantization fp8`), and pre-quantised checkpoints with a scale per output row (llm-compressor's channel
strategy), whatever each family's checkpoint layout (fused, per-head interleaved, Falcon's and GPT-NeoX's
query_key_value). MoE routers and experts stay in full precision."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.services.engine.models import CausalLM, load_model
from pagedserve.services.engine.models.fp8 import FP8_DTYPE, Fp8Linear
from pagedserve.services.engine.models.layers import ROUTER_NAMES
from tests.models.paged_driver import PagedDriver
from tests.models.tiny_models import CASES, MOE_FAMILIES, build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
_gen = torch.Generator().manual_seed(2)
PROMPTS = [torch.randint(3, 256, (n,), generator=_gen).tolist() for n in (4, 11, 19)]
_DECODER_LAYER = re.compile(r"\.(layers|h)\.\d+\.")  # Llama-likes' model.layers.N, Falcon's transformer.h.N


def _fp8_linears(model: CausalLM) -> dict[str, Fp8Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def _logits(model: CausalLM) -> torch.Tensor:
    return torch.cat(PagedDriver(model).step(dict(enumerate(PROMPTS))))


@pytest.mark.parametrize("case", list(CASES))
def test_quantised_at_load_for_every_family(case: str, tmp_path: Path) -> None:
    """Each quantised row is its full-precision row within e4m3's precision, so every family's loader fed the
    right rows (fused shards, interleaved heads); routers stay linear; the logits stay near (fp8 weights and
    per-token activations on this wide-init tiny model: 8-40% relative, see test_fp8.py)."""
    build_tiny_model(case, tmp_path)
    full = load_model(tmp_path, dtype="fp32", device="cpu", show_progress=False)
    fp8 = load_model(tmp_path, dtype="fp32", device="cpu", show_progress=False, quantization="fp8")
    linears = _fp8_linears(fp8)
    assert len(linears) >= 2 * 2  # at least the attention's two per layer
    for name, layer in linears.items():
        want = full.get_parameter(f"{name}.weight")
        got = layer.weight.float() * layer.weight_scale[:, None]
        assert float(((got - want).abs() / want.abs().amax(dim=1, keepdim=True)).max()) <= 2**-4, name
    routers = [n for n, m in fp8.named_modules() if n.rpartition(".")[2] in ROUTER_NAMES]
    assert (len(routers) > 0) == (CASES[case][0] in MOE_FAMILIES)
    assert all(isinstance(fp8.get_submodule(n), torch.nn.Linear) for n in routers)
    reference = _logits(full)
    assert 0 < float((_logits(fp8) - reference).norm() / reference.norm()) < 0.45


def _write_prequantised(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """Every decoder linear's and expert's weight as fp8 with a [N, 1] scale (routers as they are); returns the
    dequantised tensors the checkpoint stands for."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    out, dequantised = {}, {}
    for name, t in tensors.items():
        module = name.rsplit(".", 2)[-2]
        if _DECODER_LAYER.search(name) and name.endswith(".weight") and t.dim() == 2 and module not in ROUTER_NAMES:
            scale = t.abs().amax(dim=1, keepdim=True).float() / 448.0
            q = (t / scale).to(FP8_DTYPE)
            out[name], out[f"{name}_scale"] = q, scale
            dequantised[name] = q.float() * scale
        else:
            out[name] = dequantised[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequantised


@pytest.mark.parametrize("case", [c for c, (family, _, _) in CASES.items() if family != "gpt_oss"])
def test_prequantised_per_row_checkpoints_load_exactly_for_every_family(case: str, tmp_path: Path) -> None:
    """Per-row scales must follow the rows wherever a family reorders or splits them at load."""
    src, dst = tmp_path / "full", tmp_path / "fp8"
    src.mkdir()
    dst.mkdir()
    build_tiny_model(case, src)
    dequantised = _write_prequantised(src, dst)
    fp8 = load_model(dst, dtype="fp32", device="cpu", show_progress=False)  # detected from the config
    reference = load_model(src, dtype="fp32", device="cpu", show_progress=False, tensors=dequantised.items())
    linears = _fp8_linears(fp8)
    assert len(linears) >= 2 * 2
    for name, layer in linears.items():
        got = layer.weight.float() * layer.weight_scale[:, None]
        want = reference.get_parameter(f"{name}.weight")
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
    experts = {n: p for n, p in fp8.named_parameters() if ".experts." in n}
    assert (len(experts) > 0) == (CASES[case][0] in MOE_FAMILIES)
    for name, param in experts.items():  # dequantised as they loaded: the same full-precision experts
        torch.testing.assert_close(param, reference.get_parameter(name), atol=0, rtol=0, msg=name)
