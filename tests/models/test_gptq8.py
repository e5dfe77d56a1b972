"""8-bit GPTQ checkpoints: tensors written from AutoGPTQ's packing (bytes in place of nibbles, zeros stored minus
one in v1) dequantise to the weight they mean, element by element on hand-packed values; a tiny Llama of them
(plain groups, act order, one group per channel; settings in config.json or in quantize_config.json) generates
what HF transformers generates with those weights, and so does a MoE of them (experts per expert, as
Qwen3-30B-A3B-GPTQ-Int8 stores them; routers in full precision); bad tensors fail at load naming them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.gptq8 import dequantize_gptq8, gptq8_format
from pagedserve.services.engine.models.int4 import Int4Linear, int4_format
from pagedserve.services.engine.models.loader import resolve_quantization
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.models.int4_checkpoints import (
    _to_int32,
    assert_logits_match_hf,
    rewrite_decoder_linears,
    write_quantized_llama,
)
from tests.models.tiny_models import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


def pack_rows8(q: torch.Tensor) -> torch.Tensor:
    """[K, N] bytes -> [K/4, N] int32, byte i <- row 4r + i (AutoGPTQ's qweight for bits 8)."""
    v = q.numpy().astype(np.int64)
    packed = np.zeros((v.shape[0] // 4, v.shape[1]), dtype=np.int64)
    for i in range(4):
        packed |= v[i::4, :] << (8 * i)
    return _to_int32(packed)


def pack_columns8(z: torch.Tensor) -> torch.Tensor:
    """[G, N] bytes -> [G, N/4] int32, byte i <- column 4c + i (AutoGPTQ's qzeros for bits 8)."""
    v = z.numpy().astype(np.int64)
    packed = np.zeros((v.shape[0], v.shape[1] // 4), dtype=np.int64)
    for i in range(4):
        packed |= v[:, i::4] << (8 * i)
    return _to_int32(packed)


def gptq8_tensors(
    weight: torch.Tensor, group_size: int, act_order: bool, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """W [K, N] -> (v1 checkpoint tensors, the W [K, N] they mean): asymmetric 8 bits per group (0: one group)."""
    k = weight.shape[0]
    size = group_size or k
    groups = torch.arange(k) // size
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(seed))] = groups.to(torch.int32)
        groups = g_idx.long()
    else:
        g_idx = groups.to(torch.int32)  # AutoGPTQ writes the plain one too
    num_groups = k // size
    lo = torch.stack([weight[groups == g].min(dim=0).values for g in range(num_groups)])
    hi = torch.stack([weight[groups == g].max(dim=0).values for g in range(num_groups)])
    scales = ((hi - lo) / 255).clamp(min=1e-6).half()
    zeros = torch.round(-lo / scales.float()).clamp(1, 255).to(torch.int64)  # v1 stores z - 1: z >= 1
    q = torch.round(weight / scales.float()[groups] + zeros[groups]).clamp(0, 255).to(torch.int64)
    tensors = {"qweight": pack_rows8(q), "qzeros": pack_columns8(zeros - 1), "scales": scales, "g_idx": g_idx}
    return tensors, (q - zeros[groups]).float() * scales.float()[groups]


def test_hand_packed_bytes_dequantize_to_the_values_they_mean() -> None:
    """One int32 of qweight holds rows 0..3 of a column, byte 0 first; one of qzeros holds columns 0..3."""
    # Column 0: rows 0..3 are 1, 2, 3, 250; column 1: 0, 255, 7, 8 (K = 4, N = 4, one group).
    column0 = 1 | 2 << 8 | 3 << 16 | 250 << 24
    column1 = 0 | 255 << 8 | 7 << 16 | 8 << 24
    qweight = _to_int32(np.array([[column0, column1, 0, 0]], dtype=np.int64))
    # Stored zeros (v1: z - 1) of columns 0..3: 127, 0, 9, 200, i.e. z = 128, 1, 10, 201.
    qzeros = _to_int32(np.array([[127 | 0 << 8 | 9 << 16 | 200 << 24]], dtype=np.int64))
    scales = torch.tensor([[0.5, 2.0, 1.0, 1.0]], dtype=torch.float16)
    w = dequantize_gptq8(qweight, qzeros, scales, None, 0, 1)
    assert w.shape == (4, 4)
    assert w[:, 0].tolist() == [(v - 128) * 0.5 for v in (1, 2, 3, 250)]
    assert w[:, 1].tolist() == [(v - 1) * 2.0 for v in (0, 255, 7, 8)]
    assert w[:, 2].tolist() == [-10.0] * 4 and w[:, 3].tolist() == [-201.0] * 4


def test_configs() -> None:
    assert gptq8_format({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 64}}) == (64, 1)
    assert gptq8_format(
        {"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2"}}
    ) == (0, 0)
    assert gptq8_format({"quantization_config": {"quant_method": "gptq", "bits": 4}}) is None
    assert int4_format({"quantization_config": {"quant_method": "gptq", "bits": 8}}) is None
    with pytest.raises(ValueError, match="3-bit weights is not supported"):
        int4_format({"quantization_config": {"quant_method": "gptq", "bits": 3}})
    assert resolve_quantization("gptq", {"quantization_config": {"quant_method": "gptq", "bits": 8}}) == "gptq-8bit"


def _checkpoint(model_dir: Path, group_size: int, act_order: bool, beside: bool = False) -> PreTrainedModel:
    """A tiny Llama whose decoder linears are 8-bit GPTQ; returns HF's model with the weights the checkpoint
    means. `beside`: the settings go in quantize_config.json (older AutoGPTQ exports), not config.json."""

    def quantize(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        tensors, meaning = gptq8_tensors(weight.t().contiguous(), group_size, act_order, seed=weight.shape[1])
        return tensors, meaning.t()

    settings = {"bits": 8, "group_size": group_size or -1, "desc_act": act_order, "sym": False}
    hf = write_quantized_llama(model_dir, quantize, None if beside else {"quant_method": "gptq", **settings})
    if beside:
        (model_dir / "quantize_config.json").write_text(json.dumps(settings))
    return hf


@pytest.mark.parametrize(
    ("group_size", "act_order", "beside"), [(32, False, False), (32, True, True), (0, False, False)]
)
def test_greedy_generation_matches_hf_on_the_meant_weights(
    tmp_path: Path, group_size: int, act_order: bool, beside: bool
) -> None:
    hf = _checkpoint(tmp_path, group_size, act_order, beside)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantization="gptq")
    assert not any(isinstance(m, Int4Linear) for m in ours.modules())
    assert isinstance(ours.get_submodule("model.layers.0.mlp.down_proj"), nn.Linear)
    config = Config.of(model=str(tmp_path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    prompts = [[5, 17, 42, 99, 3, 250, 8], [9, 1, 200]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [r.token_ids for r in Engine(config, model=ours).generate(prompts, params)]
    assert got == [hf_greedy(hf, p, 32) for p in prompts]


def test_bad_tensors_fail_at_load_naming_them(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 32, False)
    path = tmp_path / "model.safetensors"
    good = load_file(str(path))
    name = "model.layers.1.mlp.up_proj.scales"
    save_file({**good, name: good[name][:1].contiguous()}, str(path))  # one group instead of two
    with pytest.raises(ValueError, match=rf"{name}: shape \(1, 128\), expected \(2, 128\)"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    g_idx = "model.layers.0.self_attn.q_proj.g_idx"
    save_file({**good, g_idx: good[g_idx].flip(0).contiguous()}, str(path))  # act order, but desc_act false
    with pytest.raises(ValueError, match=rf"{g_idx}: rows in act order"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    save_file({k: v for k, v in good.items() if k != "model.layers.0.mlp.down_proj.qzeros"}, str(path))
    with pytest.raises(ValueError, match=r"lack tensors: \{'model.layers.0.mlp.down_proj': \['qzeros'\]\}"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)


@pytest.mark.parametrize("case", ["qwen3_moe-qknorm-normtopk", "mixtral-moe-top2-renormalized"])
def test_an_8bit_moe_checkpoint_matches_hf_on_its_weights(case: str, tmp_path: Path) -> None:
    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        packed, meant_w = gptq8_tensors(weight.t().contiguous().float(), 16, False, seed=0)
        return packed, meant_w.t().contiguous()

    settings = {"quant_method": "gptq", "bits": 8, "group_size": 16, "desc_act": False}
    hf = rewrite_decoder_linears(case, tmp_path / "model", convert, settings)
    ours = load_model(tmp_path / "model", dtype="float32", device="cpu", show_progress=False)
    assert_logits_match_hf(ours, hf, {0: [5, 17, 42, 99, 3, 250, 8], 1: [9, 1, 200]})
