"""4-bit AWQ / GPTQ linears: checkpoint tensors written from the formats' specifications load into
Int4Linear (whole and as fused shards) and compute x @ W for the W they mean."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedserve.services.engine.models.int4 import (
    Int4Linear,
    dequantize,
    int4_format,
    largest_dequantized_bytes,
    quantize_linears_int4,
)
from pagedserve.services.engine.models.int4_repack import group_sort, tile_rows
from tests.models.int4_checkpoints import awq_tensors, gptq_tensors, pack_rows

K, N, GROUP = 256, 96, 64


def _tensors(fmt: str, weight: torch.Tensor, act_order: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return awq_tensors(weight, GROUP) if fmt == "awq" else gptq_tensors(weight, GROUP, act_order)


@pytest.mark.parametrize(("fmt", "act_order"), [("awq", False), ("gptq", False), ("gptq", True)])
def test_unpacking_gives_the_weight_the_checkpoint_means(fmt: str, act_order: bool) -> None:
    tensors, meaning = _tensors(fmt, torch.randn(K, N), act_order)
    got = dequantize(
        fmt,
        tensors["qweight"],
        tensors["qzeros"],
        tensors["scales"].float(),
        tensors.get("g_idx"),
        GROUP,
        zero_offset=1 if fmt == "gptq" else 0,
    )
    torch.testing.assert_close(got, meaning, rtol=0, atol=0)


@pytest.mark.parametrize(("fmt", "act_order"), [("awq", False), ("gptq", False), ("gptq", True)])
def test_fused_shards_load_and_multiply(fmt: str, act_order: bool) -> None:
    """q (64 outputs) and k (32 outputs) of one input, loaded into one fused 96-output layer."""
    weights = {"q": torch.randn(K, 64), "k": torch.randn(K, 32)}
    layer = Int4Linear(
        K,
        N,
        bias=False,
        dtype=torch.float32,
        fmt=fmt,
        group_size=GROUP,
        zero_offset=1 if fmt == "gptq" else 0,
        shard_offsets={"q": (0, 64), "k": (64, 32)},
    )
    meanings = []
    for shard, weight in weights.items():
        # Under act order both shards of one input share its permutation (seed), as GPTQ writes them.
        tensors, meaning = gptq_tensors(weight, GROUP, True, seed=7) if act_order else _tensors(fmt, weight)
        meanings.append(meaning)
        for name, tensor in tensors.items():
            written = layer.load_weight(name, tensor if name != "scales" else tensor.float(), shard)
            assert name in written and set(written) <= {name, "g_idx"}
    assert layer.has_act_order == act_order
    x = torch.randn(5, K)
    torch.testing.assert_close(layer(x), x @ torch.cat(meanings, dim=1), rtol=1e-4, atol=1e-4)


def test_a_shard_of_the_wrong_shape_names_the_tensor() -> None:
    layer = Int4Linear(K, N, bias=False, dtype=torch.float32, fmt="awq", group_size=GROUP)
    tensors, _ = awq_tensors(torch.randn(K, N), 32)  # a group size the layer was not built for
    with pytest.raises(ValueError, match="qzeros: shape"):
        layer.load_weight("qzeros", tensors["qzeros"], None)


def test_checkpoint_configs() -> None:
    assert int4_format(
        {
            "quantization_config": {
                "quant_method": "awq",
                "bits": 4,
                "group_size": 128,
                "version": "gemm",
                "zero_point": True,
            }
        }
    ) == ("awq", 128, 0)
    assert int4_format(
        {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}}
    ) == ("gptq", 32, 1)
    assert int4_format(
        {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}}
    ) == ("gptq", 128, 0)
    assert int4_format({}) is None and int4_format({"quantization_config": {"quant_method": "fp8"}}) is None
    assert int4_format({"quantization_config": {"quant_method": "gptq", "bits": 8}}) is None  # models/gptq8.py's
    with pytest.raises(ValueError, match="8-bit"):
        int4_format({"quantization_config": {"quant_method": "awq", "bits": 8}})
    with pytest.raises(ValueError, match="gemv"):
        int4_format({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}})


def test_decoder_linears_are_swapped_and_the_head_is_not() -> None:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.ModuleDict({"proj": nn.Linear(K, N)})])
    model.lm_head = nn.Linear(K, N)
    assert quantize_linears_int4(model, "gptq", GROUP, 1) == 1
    assert isinstance(model.get_submodule("model.layers.0.proj"), Int4Linear)
    assert isinstance(model.lm_head, nn.Linear)


@pytest.mark.parametrize(("fmt", "act_order"), [("awq", False), ("gptq", False), ("gptq", True)])
def test_finish_loading_repacks_to_the_tiled_layout_and_keeps_the_weight(fmt: str, act_order: bool) -> None:
    """AWQ becomes GPTQ's row packing, act order's groups consecutive (x gathered by input_perm), then the rows
    interleaved in tiles: exactly the same W, and the same x @ W from the layer's (CPU) forward."""
    torch.manual_seed(4)
    weight = torch.randn(K, N) * 0.05
    tensors, meaning = _tensors(fmt, weight, act_order)
    layer = Int4Linear(K, N, False, torch.float32, fmt, GROUP, zero_offset=1 if fmt == "gptq" else 0)
    layer.to_empty(device="cpu")
    for name, tensor in tensors.items():
        layer.load_weight(name, tensor, None)
    layer.finish_loading()
    assert layer.packed_fmt == "tiled" and layer.qweight.shape == (K // 8, N) and layer.act_order is None
    assert (layer.input_perm is not None) == act_order
    torch.testing.assert_close(layer.dequantized(), meaning, rtol=0, atol=1e-6)
    x = torch.randn(2, K)
    torch.testing.assert_close(layer(x), x @ meaning, rtol=1e-4, atol=1e-4)


def test_act_order_with_uneven_groups_stays_for_the_gemm() -> None:
    """A g_idx that does not give each group `group_size` rows cannot be sorted into plain groups."""
    g_idx = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1], dtype=torch.int32)
    assert group_sort(g_idx, 4) is None
    assert torch.equal(group_sort(torch.tensor([1, 0, 1, 0], dtype=torch.int32), 2), torch.tensor([1, 3, 0, 2]))


def test_the_tiled_layout_by_hand() -> None:
    """Packed row 16t + j, nibble i holds input 128t + 16i + j (models/int4_repack.py), checked on codes that
    name their own input row; dequantize reads it back in input order."""
    k, n = 256, 8
    codes = (torch.arange(k).view(-1, 1) * 7 + torch.arange(n).view(1, -1)) % 16  # a code per (row, column)
    tiled = tile_rows(pack_rows(codes))
    for t, j, i in [(0, 0, 0), (0, 3, 1), (1, 15, 7), (1, 2, 5), (0, 15, 7)]:
        word = tiled[16 * t + j]
        assert torch.equal((word >> (4 * i)) & 0xF, codes[128 * t + 16 * i + j].to(torch.int32))
    zeros = torch.zeros(k // 128, n // 8, dtype=torch.int32)
    scales = torch.ones(k // 128, n)
    assert torch.equal(dequantize("tiled", tiled, zeros, scales, None, 128), codes.float())


def test_the_largest_tiled_weight_is_what_a_prefill_step_dequantises() -> None:
    """The KV budget sets aside the biggest tiled layer's whole weight in the activation dtype (graph scratch);
    layers left in GPTQ's layout (K not whole tiles) are never dequantised whole."""
    model = nn.Module()
    model.small = Int4Linear(256, 64, False, torch.bfloat16, "gptq", 64)
    model.big = Int4Linear(256, 160, False, torch.bfloat16, "gptq", 64)
    model.untiled = Int4Linear(192, 512, False, torch.bfloat16, "gptq", 64)
    for layer in (model.small, model.big, model.untiled):
        tensors, _ = gptq_tensors(torch.randn(layer.in_features, layer.out_features) * 0.05, 64)
        for name, tensor in tensors.items():
            layer.load_weight(name, tensor, None)
        layer.finish_loading()
    assert model.untiled.packed_fmt == "gptq" and model.big.packed_fmt == "tiled"
    assert largest_dequantized_bytes(model) == 256 * 160 * 2
