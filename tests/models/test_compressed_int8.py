"""compressed-tensors 8-bit int weights: W8A8-INT8 ("int-quantized": int8 tensors) and W8A16 ("pack-quantized",
four values an int32 stored + 128, zero points packed along the outputs), written here from compressed_tensors'
specification. Hand-packed words unpack to the values they hold; a tiny Llama of each scheme (tensor, channel or
group scales, symmetric or not, static input scales dropped) generates what HF transformers generates with the
weights the checkpoint means; bad tensors fail at load naming them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.compressed_int8 import Int8Weights, int8_weights_format, unpack_int8
from pagedserve.services.engine.models.compressed_tensors import pack_quantized_format
from pagedserve.services.engine.models.loader import resolve_quantization
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.models.int4_checkpoints import _to_int32, write_quantized_llama
from tests.models.tiny_models import hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


def pack8(values: torch.Tensor, dim: int) -> torch.Tensor:
    """pack_to_int32 for 8 bits: signed values stored + 128, four per int32 along `dim` (1: inputs, 0: outputs)."""
    v = (values.to(torch.int64) + 128).numpy()
    if dim == 0:
        v = v.T
    packed = np.zeros((v.shape[0], -(-v.shape[1] // 4)), dtype=np.int64)
    for i in range(4):
        column = v[:, i::4]
        packed[:, : column.shape[1]] |= column << (8 * i)
    out = _to_int32(packed)
    return out.t().contiguous() if dim == 0 else out


def int8_tensors(
    weight: torch.Tensor, strategy: str, symmetric: bool, packed: bool, group: int = 32
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """HF's W [N, K] -> (checkpoint tensors of one linear, the W [N, K] they mean)."""
    n, k = weight.shape
    blocks = {
        "tensor": weight.reshape(1, 1, -1),
        "channel": weight.reshape(n, 1, k),
        "group": weight.reshape(n, k // group, group),
    }[strategy]
    lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
    if symmetric:
        scale, zero = torch.maximum(-lo, hi) / 127, torch.zeros_like(lo)
    else:
        scale = (hi - lo) / 255
        zero = torch.round(-128 - lo / scale).clamp(-128, 127)
    scale = scale.clamp(min=1e-6).to(torch.bfloat16)
    q = torch.round(blocks / scale.float()[..., None] + zero[..., None]).clamp(-128, 127)
    meaning = ((q - zero[..., None]) * scale.float()[..., None]).reshape(n, k)
    q = q.reshape(n, k).to(torch.int8)
    scale_shape = {"tensor": (1,), "channel": (n, 1), "group": (n, k // group)}[strategy]
    tensors = {"weight_scale": scale.reshape(scale_shape)}
    if packed:
        tensors |= {"weight_packed": pack8(q, 1), "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    else:
        tensors |= {"weight": q, "input_scale": torch.tensor([0.02])}  # static activations: dropped
    if not symmetric:
        zero = zero.reshape(scale_shape).to(torch.int8)
        tensors["weight_zero_point"] = pack8(zero, 0) if packed and strategy != "tensor" else zero
    return tensors, meaning


def int8_config(strategy: str, symmetric: bool, packed: bool, group: int = 32) -> dict[str, object]:
    """config.json's quantization_config as llm-compressor writes W8A8 (int-quantized) / W8A16 (pack-quantized)."""
    fmt = "pack-quantized" if packed else "int-quantized"
    weights = {"num_bits": 8, "type": "int", "symmetric": symmetric, "strategy": strategy, "dynamic": False}
    weights["group_size"] = group if strategy == "group" else None
    activations = (
        None if packed else {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    )
    group_0 = {"targets": ["Linear"], "weights": weights, "input_activations": activations, "format": fmt}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group_0},
        "ignore": ["lm_head"],
    }


def test_hand_packed_words_unpack_to_their_values() -> None:
    """Value i of a word sits at bits 8i, stored + 128: inputs along a row, or outputs down a column."""
    word = (0 + 128) | (-1 + 128) << 8 | (127 + 128) << 16 | (-128 + 128) << 24
    packed = _to_int32(np.array([[word]], dtype=np.int64))
    assert unpack_int8(packed, 1).tolist() == [[0, -1, 127, -128]]
    assert unpack_int8(packed, 0).tolist() == [[0], [-1], [127], [-128]]
    assert torch.equal(pack8(torch.tensor([[0, -1, 127, -128]]), 1), packed)  # the test's writer agrees


def test_configs() -> None:
    assert int8_weights_format({"quantization_config": int8_config("channel", True, False)}) == Int8Weights(
        False, 0, True, ("lm_head",)
    )
    assert int8_weights_format({"quantization_config": int8_config("group", False, True)}) == Int8Weights(
        True, 32, False, ("lm_head",)
    )
    qc = int8_config("channel", True, False)
    assert pack_quantized_format({"quantization_config": qc}) is None  # not the 4-bit path's
    assert resolve_quantization("compressed-tensors", {"quantization_config": qc}) == "compressed-tensors-int8"
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "block"  # type: ignore[index]
    with pytest.raises(ValueError, match="strategy 'block' are not supported"):
        int8_weights_format({"quantization_config": qc})


def _checkpoint(model_dir: Path, strategy: str, symmetric: bool, packed: bool) -> PreTrainedModel:
    return write_quantized_llama(
        model_dir,
        lambda weight: int8_tensors(weight, strategy, symmetric, packed),
        int8_config(strategy, symmetric, packed),
    )


@pytest.mark.parametrize(
    ("strategy", "symmetric", "packed"),
    [("channel", True, False), ("tensor", False, False), ("group", False, True), ("channel", True, True)],
)
def test_greedy_generation_matches_hf_on_the_meant_weights(
    tmp_path: Path, strategy: str, symmetric: bool, packed: bool
) -> None:
    hf = _checkpoint(tmp_path, strategy, symmetric, packed)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantization="compressed-tensors")
    assert isinstance(ours.get_submodule("model.layers.0.mlp.down_proj"), nn.Linear)
    config = Config.of(model=str(tmp_path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    prompts = [[5, 17, 42, 99, 3, 250, 8], [9, 1, 200]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [r.token_ids for r in Engine(config, model=ours).generate(prompts, params)]
    assert got == [hf_greedy(hf, p, 32) for p in prompts]


def test_bad_tensors_fail_at_load_naming_them(tmp_path: Path) -> None:
    _checkpoint(tmp_path, "group", False, True)
    path = tmp_path / "model.safetensors"
    good = load_file(str(path))
    name = "model.layers.1.mlp.up_proj.weight_scale"
    save_file({**good, name: good[name][:, :1].contiguous()}, str(path))
    with pytest.raises(ValueError, match=rf"{name}: shape \(128, 1\), expected \(128, 2\)"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    save_file({k: v for k, v in good.items() if k != "model.layers.0.mlp.down_proj.weight_zero_point"}, str(path))
    with pytest.raises(ValueError, match=r"lack tensors: \{'model.layers.0.mlp.down_proj': \['weight_zero_point'\]\}"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
