"""compressed-tensors "pack-quantized" int4 checkpoints (llm-compressor's W4A16): tensors written from the
format's specification (compressed_tensors' pack_to_int32, signed values stored + 8, zero points packed
along the outputs) convert to GPTQ's layout, load into Int4Linear and mean the weight they were written for;
a tiny Llama of them generates what HF transformers generates with those weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.compressed_tensors import (
    PackQuantized,
    gptq_stream,
    ignored,
    pack_quantized_format,
)
from pagedserve.services.engine.models.int4 import Int4Linear
from pagedserve.services.engine.models.loader import resolve_quantization
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.models.int4_checkpoints import pack_quantized_config, pack_quantized_tensors
from tests.models.tiny_models import build_tiny_model, hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")
K, GROUP = 64, 16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = [  # (group size (0: channel), symmetric, act order)
    (GROUP, True, False),
    (GROUP, False, False),
    (0, True, False),
    (0, False, False),
    (GROUP, True, True),
    (GROUP, False, True),
]


def _layer(scheme: PackQuantized, n: int, shards: dict[str, tuple[int, int]] | None = None) -> Int4Linear:
    return Int4Linear(K, n, False, torch.float32, "gptq", scheme.group_size or K, 0, shards)


def _load(layer: Int4Linear, tensors: dict[str, torch.Tensor], scheme: PackQuantized, shard: str | None) -> None:
    for name, tensor in gptq_stream(((f"x.{k}", v) for k, v in tensors.items()), scheme):
        layer.load_weight(name.removeprefix("x."), tensor, shard)


def test_hand_packed_tensors_dequantize_to_the_values_they_mean() -> None:
    """8 outputs x 8 inputs, one group per channel, asymmetric: every nibble written by hand."""
    # Row n packs inputs 0..7 as nibbles 0..7 (low bits first), each stored + 8: 0x76543210 is q = -8..-1.
    rows = [0x76543210, 0xFEDCBA98, 0x88888888, 0x00000000, 0x01234567, 0x89ABCDEF, 0x8888888F, 0x08888888]
    packed = torch.tensor([[r - (1 << 32) if r >= 1 << 31 else r] for r in rows], dtype=torch.int32)
    q = torch.tensor(
        [
            [-8, -7, -6, -5, -4, -3, -2, -1],
            [0, 1, 2, 3, 4, 5, 6, 7],
            [0] * 8,
            [-8] * 8,
            [-1, -2, -3, -4, -5, -6, -7, -8],
            [7, 6, 5, 4, 3, 2, 1, 0],
            [7, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, -8],
        ]
    )
    # Zero points of the 8 outputs packed along the outputs: one int32, output i at nibble i, stored + 8.
    zeros = torch.tensor([-8, -1, 0, 1, 2, 3, 7, -3])
    zero_packed = torch.tensor([[sum((int(z) + 8) << (4 * i) for i, z in enumerate(zeros)) - (1 << 32)]])
    scales = torch.arange(1, 9, dtype=torch.float32)[:, None] / 4  # [N, 1]: per channel
    scheme = PackQuantized(0, symmetric=False, ignore=())
    layer = Int4Linear(8, 8, False, torch.float32, "gptq", 8, 0)
    tensors = {"weight_packed": packed, "weight_scale": scales, "weight_zero_point": zero_packed.to(torch.int32)}
    for name, tensor in gptq_stream(((f"x.{k}", v) for k, v in tensors.items()), scheme):
        layer.load_weight(name.removeprefix("x."), tensor, None)
    want = (q - zeros[:, None]).float() * scales  # [N, K]
    torch.testing.assert_close(layer.dequantized().t(), want, rtol=0, atol=0)
    # Symmetric: no zero point, the same nibbles mean q * s.
    layer = Int4Linear(8, 8, False, torch.float32, "gptq", 8, 0)
    _load(layer, {"weight_packed": packed, "weight_scale": scales}, PackQuantized(0, True, ()), None)
    torch.testing.assert_close(layer.dequantized().t(), q.float() * scales, rtol=0, atol=0)


@pytest.mark.parametrize(("group_size", "symmetric", "act_order"), SCHEMES)
def test_fused_shards_mean_the_written_weights(group_size: int, symmetric: bool, act_order: bool) -> None:
    """q (32 outputs) and k (16 outputs) of one input, loaded into one fused 48-output layer."""
    scheme = PackQuantized(group_size, symmetric, ())
    layer = _layer(scheme, 48, {"q": (0, 32), "k": (32, 16)})
    meanings = []
    for shard, n in (("q", 32), ("k", 16)):
        # Under act order both shards of one input share its permutation (seed), as GPTQ writes them.
        tensors, meaning = pack_quantized_tensors(torch.randn(n, K), group_size, symmetric, act_order, seed=3)
        assert tensors["weight_packed"].shape == (n, K // 8) and tensors["weight_packed"].dtype == torch.int32
        _load(layer, tensors, scheme, shard)
        meanings.append(meaning)
    assert layer.has_act_order == act_order
    want = torch.cat(meanings)  # [N, K]
    torch.testing.assert_close(layer.dequantized().t(), want, rtol=0, atol=0)
    x = torch.randn(3, K)
    torch.testing.assert_close(layer(x), x @ want.t(), rtol=1e-5, atol=1e-5)


def test_configs() -> None:
    assert pack_quantized_format({"quantization_config": pack_quantized_config(128, True)}) == PackQuantized(
        128, True, ("lm_head",)
    )
    assert pack_quantized_format({"quantization_config": pack_quantized_config(0, False)}) == PackQuantized(
        0, False, ("lm_head",)
    )
    assert pack_quantized_format({}) is None
    fp8 = pack_quantized_config(128, True)
    fp8["config_groups"]["group_0"]["weights"].update(type="float", num_bits=8)  # type: ignore[index]
    assert pack_quantized_format({"quantization_config": fp8}) is None  # fp8.py's
    assert resolve_quantization("compressed-tensors", {"quantization_config": fp8}) == "fp8"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_bits": 3}, "3-bit weights"),
        ({"strategy": "tensor"}, "strategy 'tensor'"),
        ({"strategy": "block"}, "strategy 'block'"),
    ],
)
def test_unsupported_weights_are_refused_naming_what_is_supported(change: dict[str, object], named: str) -> None:
    qc = pack_quantized_config(128, True)
    qc["config_groups"]["group_0"]["weights"].update(change)  # type: ignore[index]
    with pytest.raises(ValueError, match=f"{named} is not supported .*4-bit int weights, pack-quantized"):
        pack_quantized_format({"quantization_config": qc})


def test_activation_quantization_and_other_formats_are_refused() -> None:
    qc = pack_quantized_config(128, True)
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}  # type: ignore[index]
    with pytest.raises(ValueError, match="activation quantization is not supported"):
        pack_quantized_format({"quantization_config": qc})
    qc = pack_quantized_config(128, True)
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "int-quantized"  # type: ignore[index]
    with pytest.raises(ValueError, match=r"format \['int-quantized'\]"):
        pack_quantized_format({"quantization_config": qc})


def test_ignore_matches_fused_linears_by_their_parts() -> None:
    keep = ignored(PackQuantized(128, True, ("lm_head", "re:.*layers\\.1\\.self_attn\\.k_proj$")))
    assert keep("model.layers.1.self_attn.qkv_proj")
    assert not keep("model.layers.0.self_attn.qkv_proj") and not keep("model.layers.1.self_attn.o_proj")
    keep = ignored(PackQuantized(128, True, ("model.layers.0.mlp.down_proj",)))
    assert keep("model.layers.0.mlp.down_proj") and not keep("model.layers.10.mlp.down_proj")


def _checkpoint(
    model_dir: Path, group_size: int, symmetric: bool, act_order: bool, keep_dense: tuple[str, ...] = ()
) -> PreTrainedModel:
    """A tiny Llama whose decoder linears (but `keep_dense`) are pack-quantized; returns HF's model with the
    weights the checkpoint means."""
    hf = build_tiny_model("llama-gqa-tied-llama3rope-sharded", model_dir)
    for path in [*model_dir.glob("*.safetensors"), *model_dir.glob("*.safetensors.index.json")]:
        path.unlink()
    written = {}
    for name, weight in hf.state_dict().items():
        base = name.removesuffix(".weight")
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue  # tied: the checkpoint holds the embedding once
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEARS or base in keep_dense:
            written[name] = weight.contiguous()
            continue
        # q/k/v (gate/up) read the same inputs: under act order they share a permutation (seed: input size).
        tensors, meaning = pack_quantized_tensors(weight, group_size, symmetric, act_order, seed=weight.shape[1])
        written.update({f"{base}.{key}": value for key, value in tensors.items()})
        with torch.no_grad():
            hf.get_parameter(name).copy_(meaning)
    save_file(written, str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = pack_quantized_config(group_size, symmetric, act_order)
    config["quantization_config"]["ignore"] += list(keep_dense)
    (model_dir / "config.json").write_text(json.dumps(config))
    return hf


@pytest.mark.parametrize(
    ("group_size", "symmetric", "act_order"), [(32, True, False), (0, False, False), (32, False, True)]
)
def test_greedy_generation_matches_hf_on_the_meant_weights(
    tmp_path: Path, group_size: int, symmetric: bool, act_order: bool
) -> None:
    hf = _checkpoint(tmp_path, group_size, symmetric, act_order)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    assert sum(isinstance(m, Int4Linear) for m in ours.modules()) == 2 * 4  # qkv, o, gate_up, down per layer
    config = Config.of(model=str(tmp_path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    prompts = [[5, 17, 42, 99, 3, 250, 8], [9, 1, 200]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [r.token_ids for r in Engine(config, model=ours).generate(prompts, params)]
    assert got == [hf_greedy(hf, p, 32) for p in prompts]


def test_ignored_linears_load_in_full_precision(tmp_path: Path) -> None:
    qkv = tuple(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")  # a fused linear: all its parts
    dense = ("model.layers.0.mlp.down_proj", *qkv)
    hf = _checkpoint(tmp_path, 32, True, False, keep_dense=dense)
    ours = load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantization="compressed-tensors")
    assert isinstance(ours.get_submodule("model.layers.0.mlp.down_proj"), nn.Linear)
    assert isinstance(ours.get_submodule("model.layers.1.self_attn.qkv_proj"), nn.Linear)
    assert isinstance(ours.get_submodule("model.layers.0.self_attn.qkv_proj"), Int4Linear)
    config = Config.of(model=str(tmp_path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert Engine(config, model=ours).generate([[3, 4, 5]], params)[0].token_ids == hf_greedy(hf, [3, 4, 5], 8)


def test_a_tensor_of_the_wrong_shape_fails_at_load_naming_it(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 32, True, False)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.up_proj.weight_scale"
    tensors[name] = tensors[name][:, :1].contiguous()  # one group instead of two
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=rf"{name}: shape \(128, 1\) means 32 inputs.*weight_packed means 64"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)
    # Consistent with itself but not with the model: the layer refuses it, named as the checkpoint tensor.
    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
        tensors.pop(f"model.layers.1.mlp.up_proj.{suffix}")
    other = pack_quantized_tensors(torch.randn(128, 32), 32, True)[0]  # 32 inputs instead of 64
    tensors.update({f"model.layers.1.mlp.up_proj.{k}": v for k, v in other.items()})
    save_file(tensors, str(path))
    with pytest.raises(
        ValueError, match=re.escape("checkpoint tensor 'model.layers.1.mlp.up_proj.qweight': qweight: shape")
    ):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False)


def test_the_quantization_flag_must_name_the_checkpoints_method(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 32, True, False)
    with pytest.raises(ValueError, match="quantization 'gptq': the checkpoint's weights are 'compressed-tensors'"):
        load_model(tmp_path, dtype="float32", device="cpu", show_progress=False, quantization="gptq")
    with pytest.raises(ValueError, match="quantization 'compressed-tensors': the checkpoint's weights are 'gptq'"):
        resolve_quantization("compressed-tensors", {"quantization_config": {"quant_method": "gptq", "bits": 4}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton W4A16 kernel needs CUDA")
@pytest.mark.parametrize(("group_size", "symmetric", "act_order"), SCHEMES)
@pytest.mark.parametrize("m", [1, 40])
def test_the_cuda_kernel_serves_the_converted_weights(
    group_size: int, symmetric: bool, act_order: bool, m: int
) -> None:
    """K 896 (not a power of two): per channel, the kernel's one group spans every K tile."""
    k, n = 896, 256
    scheme = PackQuantized(group_size and 128, symmetric, ())
    layer = Int4Linear(k, n, False, torch.float16, "gptq", scheme.group_size or k, 0)
    tensors, meaning = pack_quantized_tensors(torch.randn(n, k), scheme.group_size, symmetric, act_order)
    _load(layer, tensors, scheme, None)
    layer = layer.cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    want = x.float() @ meaning.t().cuda()
    torch.testing.assert_close(layer(x).float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
