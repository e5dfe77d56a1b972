"""Quantization-config options that leave some weights unquantized or give some modules their own settings:
GPTQ's `modules_in_block_to_quantize` and `lm_head: true`, GPTQModel's `dynamic` overrides, and FP8 checkpoints'
ignored layers (`ignored_layers`, `modules_to_not_convert`, compressed-tensors' `ignore`). Each tiny checkpoint
loads and computes what HF computes on the weights it means; what it left in full precision stays so, exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.fp8 import Fp8Linear, fp8_kept_linears
from pagedserve.services.engine.models.int4 import (
    Int4Linear,
    dequantize_experts,
    refuse_per_module_overrides,
    repack_experts,
    unconverted_linears,
)
from tests.models.int4_checkpoints import (
    assert_logits_match_hf,
    fp8_rows,
    gptq_tensors,
    rewrite_decoder_linears,
    write_quantized_llama,
)
from tests.models.paged_driver import PagedDriver

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = {0: [5, 17, 42, 99, 3, 250, 8], 1: [9, 1, 200]}
GROUP = 32
LAYER0 = "model.layers.0"


def _gptq_config(**extra: Any) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False, **extra}


def _gptq(weight: torch.Tensor, act_order: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """HF's [N, K] -> GPTQ v1 tensors (g_idx always written, as AutoGPTQ / GPTQModel do) and the [N, K] meant."""
    w = weight.t().contiguous().float()
    tensors, meaning = gptq_tensors(w, GROUP, act_order, seed=len(w))  # q/k/v (gate/up) share one permutation
    tensors.setdefault("g_idx", (torch.arange(len(w)) // GROUP).to(torch.int32))
    return tensors, meaning.t().contiguous()


def _load(model_dir: Path) -> nn.Module:
    return load_model(model_dir, dtype="float32", device="cpu", show_progress=False)


# --- GPTQ modules_in_block_to_quantize ---------------------------------------------------------------------------


def test_modules_in_block_to_quantize_leaves_the_others_in_full_precision(tmp_path: Path) -> None:
    in_block = [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"], ["self_attn.o_proj"]]
    hf = write_quantized_llama(
        tmp_path,
        _gptq,
        _gptq_config(modules_in_block_to_quantize=in_block),
        keep_full=lambda name: ".mlp." in name,
    )
    ours = _load(tmp_path)
    for i in range(2):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj"):
            assert isinstance(ours.get_submodule(f"model.layers.{i}.{name}"), Int4Linear)
        for name in ("mlp.gate_up_proj", "mlp.down_proj"):
            assert type(ours.get_submodule(f"model.layers.{i}.{name}")).__name__ in ("DenseLinear", "ShardedLinear")
    assert_logits_match_hf(ours, hf, PROMPTS)


def test_modules_in_block_to_quantize_matches_fused_linears_by_their_parts_or_their_own_name() -> None:
    def keep(in_block: list[list[str]], name: str) -> bool:
        predicate = unconverted_linears({"quantization_config": _gptq_config(modules_in_block_to_quantize=in_block)})
        assert predicate is not None
        return predicate(f"{LAYER0}.{name}")

    split = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]]
    assert not keep(split, "self_attn.qkv_proj") and not keep(split, "mlp.gate_up_proj")
    assert keep(split, "self_attn.o_proj") and keep(split, "mlp.down_proj")
    fused = [["self_attn.qkv_proj"], ["mlp.down_proj"]]  # Phi-3 stores qkv_proj fused
    assert not keep(fused, "self_attn.qkv_proj") and not keep(fused, "mlp.down_proj")
    assert keep(fused, "mlp.gate_up_proj")
    with pytest.raises(ValueError, match=r"modules_in_block_to_quantize name .*q_proj.* but not .*v_proj"):
        keep([["self_attn.q_proj", "self_attn.k_proj"]], "self_attn.qkv_proj")
    rules = unconverted_linears({"quantization_config": _gptq_config(dynamic={r"-:.*\.gate_proj": {}})})
    assert rules is not None
    with pytest.raises(ValueError, match=r"gate_up_proj must share one precision"):  # '-:' rules follow the parts too
        rules(f"{LAYER0}.mlp.gate_up_proj")


# --- GPTQ lm_head: true -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("act_order", [False, True])
def test_a_quantized_lm_head_loads_dequantised(tmp_path: Path, act_order: bool) -> None:
    model_dir = tmp_path / "gptq"
    hf = rewrite_decoder_linears(
        "llama-mqa-bias-linearrope",  # its LM head is not tied to the embedding
        model_dir,
        lambda name, weight: _gptq(weight, act_order),
        _gptq_config(lm_head=True, desc_act=act_order),
    )
    state = load_file(str(model_dir / "model.safetensors"))
    head, meaning = _gptq(state.pop("lm_head.weight"), act_order)
    state.update({f"lm_head.{part}": tensor for part, tensor in head.items()})
    save_file(state, str(model_dir / "model.safetensors"))
    with torch.no_grad():
        hf.get_parameter("lm_head.weight").copy_(meaning)
    ours = _load(model_dir)
    torch.testing.assert_close(ours.get_submodule("lm_head").weight, meaning, rtol=0, atol=0)
    assert_logits_match_hf(ours, hf, PROMPTS)


def test_a_quantized_lm_head_is_dequantised_with_experts_kept_4bit() -> None:
    """The stream for 4-bit experts on the device (repack_experts) dequantises the head too, in any order."""
    head, meaning = _gptq(torch.randn((96, 64), generator=torch.Generator().manual_seed(3)))
    streamed = [("lm_head.g_idx", head["g_idx"]), *((f"lm_head.{p}", head[p]) for p in ("scales", "qzeros", "qweight"))]
    for stream in (repack_experts(streamed, "gptq", GROUP, 1), dequantize_experts(streamed, "gptq", GROUP, 1, False)):
        out = dict(stream)
        assert list(out) == ["lm_head.weight"]
        torch.testing.assert_close(out["lm_head.weight"], meaning, rtol=0, atol=0)


# --- GPTQModel dynamic overrides ----------------------------------------------------------------------------------


def test_dynamic_overrides_that_keep_the_layout_load(tmp_path: Path) -> None:
    """down_proj overrides desc_act (its rows in act order while the base config's are not) and sym; layer 1's
    o_proj is skipped ("-:"). desc_act and the zero points are read from each linear's own g_idx and qzeros."""
    dynamic = {r"+:.*down_proj": {"desc_act": True, "sym": True, "bits": 4}, r"-:.*layers\.1\.self_attn\.o_proj": {}}
    hf = write_quantized_llama(
        tmp_path,
        lambda weight: _gptq(weight, act_order=weight.shape[1] == 128),  # down_proj's 128 inputs
        _gptq_config(dynamic=dynamic),
        keep_full=lambda name: name == "model.layers.1.self_attn.o_proj.weight",
    )
    ours = _load(tmp_path)
    assert not isinstance(ours.get_submodule("model.layers.1.self_attn.o_proj"), Int4Linear)
    assert sum(isinstance(m, Int4Linear) for m in ours.modules()) == 7
    assert_logits_match_hf(ours, hf, PROMPTS)


@pytest.mark.parametrize(
    ("override", "refused"),
    [({"group_size": 64}, "group_size"), ({"bits": 8}, "bits"), ({"adapter": {"rank": 8}}, "adapter")],
)
def test_dynamic_overrides_that_change_the_layout_are_refused(override: dict[str, Any], refused: str) -> None:
    with pytest.raises(
        ValueError, match=rf"per-module overrides \(dynamic '\+:.*down_proj': \{{'{refused}'.* not supported"
    ):
        refuse_per_module_overrides(_gptq_config(dynamic={r"+:.*down_proj": override}))
    refuse_per_module_overrides(_gptq_config(dynamic={r"+:.*down_proj": {"group_size": GROUP, "desc_act": True}}))
    refuse_per_module_overrides(_gptq_config(group_size=-1, dynamic={r".*down_proj": {"group_size": -1}}))


# --- FP8 ignored layers (needs the loader to pass fp8_kept_linears(cfg) to quantize_linears) -------------------

_CT_FP8_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
}
_QKV0 = [f"{LAYER0}.self_attn.{p}_proj" for p in "qkv"]


@pytest.mark.parametrize(
    "config",
    [
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "ignored_layers": [*_QKV0, "model.layers.1.mlp.down_proj"],
        },
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "modules_to_not_convert": [
                "layers.0.self_attn.q_proj",
                "0.self_attn.k_proj",
                "0.self_attn.v",
                "1.mlp.down",
            ],
        },
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": _CT_FP8_GROUP},
            "ignore": ["lm_head", r"re:.*layers\.0\.self_attn\.[qkv]_proj$", "model.layers.1.mlp.down_proj"],
        },
    ],
    ids=["ignored_layers", "modules_to_not_convert", "compressed-tensors-ignore"],
)
def test_fp8_layers_the_checkpoint_left_unquantized_stay_exact(tmp_path: Path, config: dict[str, Any]) -> None:
    kept = (*_QKV0, "model.layers.1.mlp.down_proj")
    hf = write_quantized_llama(tmp_path, fp8_rows, config, keep_full=lambda name: name.removesuffix(".weight") in kept)
    saved = load_file(str(tmp_path / "model.safetensors"))
    ours = _load(tmp_path)
    qkv0 = ours.get_submodule(f"{LAYER0}.self_attn.qkv_proj")
    down1 = ours.get_submodule("model.layers.1.mlp.down_proj")
    assert not isinstance(qkv0, Fp8Linear) and not isinstance(down1, Fp8Linear)
    want_qkv = torch.cat([saved[f"{name}.weight"] for name in _QKV0])
    torch.testing.assert_close(qkv0.weight, want_qkv, rtol=0, atol=0)  # bit-identical, not re-quantized
    torch.testing.assert_close(down1.weight, saved["model.layers.1.mlp.down_proj.weight"], rtol=0, atol=0)
    assert sum(isinstance(m, Fp8Linear) for m in ours.modules()) == 2 * 4 - 2
    # Logits: only the fp8 linears' per-token activation rounding differs from HF on the meant weights.
    got = PagedDriver(ours).step(PROMPTS)
    for index, prompt in PROMPTS.items():
        with torch.inference_mode():
            want = hf(torch.tensor([prompt])).logits[0]
        assert ((got[index].float() - want).norm() / want.norm()).item() < 0.2


def test_fp8_kept_linears_by_config() -> None:
    plain: dict[str, Any] = {}
    assert fp8_kept_linears(plain) is None  # online fp8 of a full-precision checkpoint quantizes every linear
    assert fp8_kept_linears({"quantization_config": {"quant_method": "fp8"}}) is None
    assert fp8_kept_linears({"quantization_config": {"quant_method": "gptq", "ignored_layers": ["x"]}}) is None
    keep = fp8_kept_linears({"quantization_config": {"quant_method": "fp8", "ignored_layers": [_QKV0[0]]}})
    assert keep is not None and not keep(f"{LAYER0}.mlp.down_proj")
    with pytest.raises(ValueError, match=r"ignored layers name .*q_proj.* but not .*k_proj"):
        keep(f"{LAYER0}.self_attn.qkv_proj")
    fused = {"quant_method": "fp8", "ignored_layers": [f"{LAYER0}.self_attn.qkv_proj"]}  # Phi-3's fused name
    keep = fp8_kept_linears({"quantization_config": fused})
    assert keep is not None and keep(f"{LAYER0}.self_attn.qkv_proj") and not keep("model.layers.1.self_attn.qkv_proj")
    keep = fp8_kept_linears(
        {"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["re:.*up_proj$"]}}
    )
    with pytest.raises(ValueError, match="must share one precision"):  # up_proj alone: gate_proj is fp8
        assert keep is not None and keep(f"{LAYER0}.mlp.gate_up_proj")
