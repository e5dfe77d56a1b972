"""compressed-tensors configs that quantize some linears only, as llm-compressor writes them: config groups whose
`targets` are regexes or module names (linears no group targets stay in full precision), skip lists naming Phi-3's
fused linears, and 8-bit weights in act order (`weight_g_idx`). Tiny Llama / Phi-3 checkpoints of each load to the
logits HF transformers computes with the weights they mean; configs mixing weight schemes are refused at load,
naming their groups."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.compressed_int8 import int8_weights_format
from pagedserve.services.engine.models.compressed_tensors import PackQuantized, ignored, pack_quantized_format
from pagedserve.services.engine.models.int4 import Int4Linear
from pagedserve.services.engine.models.loader import resolve_quantization
from tests.models.int4_checkpoints import (
    assert_logits_match_hf,
    fp8_rows,
    pack_quantized_config,
    pack_quantized_tensors,
    rewrite_decoder_linears,
)
from tests.models.test_compressed_int8 import int8_config, pack8

pytestmark = pytest.mark.usefixtures("one_thread")
LLAMA, PHI3 = "llama-gqa-tied-llama3rope-sharded", "phi3-fused-partial-rotary"
GROUP = 16
PROMPTS = {0: [5, 17, 42, 99, 3, 250, 8], 1: [9, 1, 200]}


def _w4(quantized: Any = lambda name: True, symmetric: bool = True) -> Any:
    """rewrite_decoder_linears' convert: W4A16 pack-quantized tensors for the linears `quantized` names (HF weight
    names), the full-precision weight for the others."""

    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if not quantized(name):
            return {"weight": weight.contiguous()}, weight
        return pack_quantized_tensors(weight.float(), GROUP, symmetric, seed=weight.shape[1])

    return convert


def _w4_config(targets: dict[str, list[str]], ignore: list[str] | None = None) -> dict[str, Any]:
    """A W4A16 (symmetric, groups of 16) quantization_config with one config group per entry of `targets`."""
    qc = pack_quantized_config(GROUP, True)
    group = qc["config_groups"]["group_0"]  # type: ignore[index]
    qc["config_groups"] = {name: {**copy.deepcopy(group), "targets": t} for name, t in targets.items()}
    qc["ignore"] = ["lm_head", *(ignore or [])]
    return qc


def _load(model_dir: Path) -> nn.Module:
    return load_model(model_dir, dtype="float32", device="cpu", show_progress=False)


def _int4(model: nn.Module) -> list[str]:
    return sorted(name for name, module in model.named_modules() if isinstance(module, Int4Linear))


def test_two_groups_of_regex_targets_share_one_scheme(tmp_path: Path) -> None:
    qc = _w4_config({"group_0": ["re:.*self_attn.*"], "group_1": ["re:.*mlp.*"]})
    hf = rewrite_decoder_linears(LLAMA, tmp_path / "ckpt", _w4(), qc)
    ours = _load(tmp_path / "ckpt")
    assert len(_int4(ours)) == 2 * 4  # qkv, o, gate_up, down per layer
    assert_logits_match_hf(ours, hf, PROMPTS)


def test_linears_no_group_targets_stay_full_precision(tmp_path: Path) -> None:
    """Attention only (MLPs full precision), and one group naming q/k/v by regex (the fused qkv_proj is quantized:
    all its parts are) plus one down_proj by its exact name."""
    qc = _w4_config({"group_0": ["re:.*self_attn.*"]})
    hf = rewrite_decoder_linears(LLAMA, tmp_path / "attention", _w4(lambda name: "self_attn" in name), qc)
    ours = _load(tmp_path / "attention")
    assert _int4(ours) == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("o_proj", "qkv_proj")]
    assert_logits_match_hf(ours, hf, PROMPTS)

    qc = _w4_config({"group_0": ["re:.*self_attn\\.(q|k|v)_proj$"], "group_1": ["model.layers.1.mlp.down_proj"]})
    hf = rewrite_decoder_linears(LLAMA, tmp_path / "parts", _w4(_qkv_and_one_down_proj), qc)
    ours = _load(tmp_path / "parts")
    qkv = [f"model.layers.{i}.self_attn.qkv_proj" for i in (0, 1)]
    assert _int4(ours) == sorted(["model.layers.1.mlp.down_proj", *qkv])
    assert_logits_match_hf(ours, hf, PROMPTS)


def _qkv_and_one_down_proj(name: str) -> bool:
    return any(f".{p}_proj." in name for p in "qkv") or "layers.1.mlp.down_proj" in name


def _phi3_dense(name: str) -> bool:
    return "layers.0.self_attn.qkv_proj" in name or "layers.1.mlp.gate_up_proj" in name


def test_phi3_skip_lists_and_targets_name_its_fused_linears(tmp_path: Path) -> None:
    """Phi-3's checkpoints name qkv_proj / gate_up_proj themselves, not q/k/v or gate/up parts."""
    ignore = ["model.layers.0.self_attn.qkv_proj", "re:.*layers\\.1\\.mlp\\.gate_up_proj$"]
    qc = _w4_config({"group_0": ["Linear"]}, ignore)
    hf = rewrite_decoder_linears(PHI3, tmp_path / "ignore", _w4(lambda name: not _phi3_dense(name)), qc)
    ours = _load(tmp_path / "ignore")
    assert isinstance(ours.get_submodule("model.layers.0.self_attn.qkv_proj"), nn.Linear)
    assert isinstance(ours.get_submodule("model.layers.1.mlp.gate_up_proj"), nn.Linear)
    assert len(_int4(ours)) == 2 * 4 - 2
    assert_logits_match_hf(ours, hf, PROMPTS)

    qc = _w4_config({"group_0": ["re:.*self_attn.*"]})
    hf = rewrite_decoder_linears(PHI3, tmp_path / "attention", _w4(lambda name: "self_attn" in name), qc)
    ours = _load(tmp_path / "attention")
    assert _int4(ours) == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("o_proj", "qkv_proj")]
    assert_logits_match_hf(ours, hf, PROMPTS)


def test_target_matching() -> None:
    """As compressed-tensors matches: class name, "re:" re.match-ed from the start, exact name (no substring);
    a fused linear of ours is quantized when it or all of its parts are targeted, and kept when any is ignored."""
    keep = ignored(PackQuantized(16, True, ("re:.*layers\\.1\\.self_attn\\.k_proj$",), ("re:.*self_attn",)))
    assert not keep("model.layers.0.self_attn.qkv_proj") and not keep("model.layers.0.self_attn.o_proj")
    assert keep("model.layers.1.self_attn.qkv_proj") and keep("model.layers.0.mlp.down_proj")
    keep = ignored(PackQuantized(16, True, (), ("re:.*\\.(q|k)_proj$", "model.layers.0.mlp.down_proj", "down_proj")))
    assert keep("model.layers.0.self_attn.qkv_proj")  # v_proj is not targeted
    assert not keep("model.layers.0.mlp.down_proj") and keep("model.layers.1.mlp.down_proj")
    keep = ignored(PackQuantized(16, True, ("model.layers.1.mlp.gate_up_proj",), ("Linear",)))
    assert keep("model.layers.1.mlp.gate_up_proj") and not keep("model.layers.0.mlp.gate_up_proj")


def test_a_quantized_linear_the_config_leaves_full_precision_fails_at_load_naming_it(tmp_path: Path) -> None:
    qc = _w4_config({"group_0": ["re:.*self_attn.*"]})
    rewrite_decoder_linears(LLAMA, tmp_path, _w4(), qc)  # the MLPs quantized too
    with pytest.raises(ValueError, match=r"the checkpoint quantizes model\.layers\.0\.mlp\.\w+, but its quantization"):
        _load(tmp_path)


def _int8_act_order(weight: torch.Tensor, packed: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """8-bit group-quantized tensors (packed: asymmetric W8A16; else symmetric W8A8 int8) whose inputs are assigned
    to groups in a random order (`weight_g_idx`), and the W [N, K] they mean."""
    n, k = weight.shape
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(k))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // GROUP
    members = [g_idx == g for g in range(k // GROUP)]
    lo = torch.stack([weight[:, m].amin(1) for m in members], 1).clamp(max=0)  # [N, K/G]
    hi = torch.stack([weight[:, m].amax(1) for m in members], 1).clamp(min=0)
    if packed:
        scale = ((hi - lo) / 255).clamp(min=1e-6).to(torch.bfloat16).float()
        zero = torch.round(-128 - lo / scale).clamp(-128, 127)
    else:
        scale, zero = (torch.maximum(-lo, hi) / 127).clamp(min=1e-6).to(torch.bfloat16).float(), torch.zeros_like(lo)
    q = torch.round(weight / scale[:, g_idx] + zero[:, g_idx]).clamp(-128, 127)
    tensors = {"weight_scale": scale.to(torch.bfloat16), "weight_g_idx": g_idx.to(torch.int32)}
    if packed:
        tensors |= {"weight_packed": pack8(q, 1), "weight_shape": torch.tensor([n, k])}
        tensors["weight_zero_point"] = pack8(zero, 0)
    else:
        tensors["weight"] = q.to(torch.int8)
    return tensors, (q - zero[:, g_idx]) * scale[:, g_idx]


@pytest.mark.parametrize("packed", [True, False], ids=["w8a16-packed", "w8a8-int"])
def test_8bit_act_order_groups_follow_g_idx(tmp_path: Path, packed: bool) -> None:
    qc = int8_config("group", not packed, packed, group=GROUP)
    qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"  # type: ignore[index]
    scheme = int8_weights_format({"quantization_config": qc})
    assert scheme is not None and scheme.act_order
    hf = rewrite_decoder_linears(LLAMA, tmp_path, lambda name, w: _int8_act_order(w.float(), packed), qc)
    assert_logits_match_hf(_load(tmp_path), hf, PROMPTS)


def test_groups_with_different_weight_schemes_are_refused_at_load_naming_them(tmp_path: Path) -> None:
    """FP8 attention with W4A16 MLPs: one scheme for all linears is what loads, so say so before reading tensors."""

    def convert(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if "self_attn" not in name:
            return pack_quantized_tensors(weight.float(), GROUP, True)
        return fp8_rows(weight)

    qc = _w4_config({"group_0": ["re:.*self_attn.*"], "group_1": ["re:.*mlp.*"]})
    qc["format"] = "mixed-precision"
    float8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
    qc["config_groups"]["group_0"].update(format="float-quantized", weights=float8)
    rewrite_decoder_linears(LLAMA, tmp_path, convert, qc)
    named = r"group_0 \(targets \['re:\.\*self_attn\.\*'\]: float 8-bit channel\), group_1 .*int 4-bit group 16\)"
    with pytest.raises(ValueError, match=f"different weight schemes are not supported: {named}; supported: one"):
        _load(tmp_path)
    # 8-bit and 4-bit int groups, and two 8-bit schemes, alike
    qc = _w4_config({"group_0": ["re:.*self_attn.*"], "group_1": ["re:.*mlp.*"]})
    qc["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    with pytest.raises(ValueError, match=r"group_0 .*int 8-bit group 16.*group_1 .*int 4-bit group 16"):
        resolve_quantization(None, {"quantization_config": qc})
    qc = int8_config("channel", True, True)
    group = qc["config_groups"]["group_0"]  # type: ignore[index]
    qc["config_groups"] = {"attn": group, "mlp": {**group, "weights": {**group["weights"], "symmetric": False}}}
    with pytest.raises(ValueError, match=r"attn .*int 8-bit channel\), mlp .*int 8-bit channel asymmetric"):
        int8_weights_format({"quantization_config": qc})
    # the same scheme with other observers is one scheme
    qc = _w4_config({"group_0": ["re:.*self_attn.*"], "group_1": ["re:.*mlp.*"]})
    qc["config_groups"]["group_1"]["weights"]["observer"] = "mse"
    targets = ("re:.*self_attn.*", "re:.*mlp.*")
    assert pack_quantized_format({"quantization_config": qc}) == PackQuantized(GROUP, True, ("lm_head",), targets)
