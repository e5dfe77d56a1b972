"""The W4A16 GEMM kernel vs x @ W for the W the AWQ / GPTQ tensors mean (written from the formats'
specifications in tests/models/int4_checkpoints.py): decode and prefill tile sizes, ragged edges,
GPTQ act order, the tiled layout Int4Linear repacks to (both MMA orientations, a tile's slices in one dot or
eight, groups of 32-192),
fp16/bf16 on CUDA (fp32 in the interpreter)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.w4a16_gemm import DEQUANTIZE_ABOVE_ROWS, Tiles, dequantize_tiled, k_slices, w4a16_matmul
from pagedserve.kernels.w4a16_gemv import reserve_split_counters
from pagedserve.services.engine.models.int4 import dequantize
from pagedserve.services.engine.models.int4_repack import tile_rows
from tests.models.int4_checkpoints import awq_tensors, gptq_tensors


@pytest.mark.parametrize(("fmt", "act_order"), [("awq", False), ("gptq", False), ("gptq", True), ("tiled", False)])
@pytest.mark.parametrize(("m", "k", "n", "group"), [(1, 256, 128, 128), (5, 256, 96, 64), (70, 128, 200, 32)])
def test_w4a16_matches_the_dequantized_weight(
    device: torch.device, fmt: str, act_order: bool, m: int, k: int, n: int, group: int
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(k, n) * 0.05
    tensors, meaning = awq_tensors(weight, group) if fmt == "awq" else gptq_tensors(weight, group, act_order)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(m, k).to(device, dtype)
    g_idx = tensors.get("g_idx")
    qweight = tile_rows(tensors["qweight"]) if fmt == "tiled" else tensors["qweight"]
    got = w4a16_matmul(
        x,
        qweight.to(device),
        tensors["qzeros"].to(device),
        tensors["scales"].to(device, dtype),
        None if g_idx is None else g_idx.to(device),
        group,
        fmt,
        zero_offset=0 if fmt == "awq" else 1,
    )
    want = x.float() @ meaning.to(device)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


@pytest.mark.parametrize("m", [1, 40])
def test_act_order_rows_of_a_shard_index_every_groups_scales(device: torch.device, m: int) -> None:
    """A tensor-parallel rank's input rows of an act-order weight (parallel/int4.RowParallelInt4): its g_idx
    names groups of the whole weight, so the GEMM reads scales and zero points of more groups than its rows."""
    torch.manual_seed(1)
    k, n, group, first, rows = 256, 64, 32, 128, 128  # the second half of the inputs, as rank 1 of 2 holds it
    tensors, meaning = gptq_tensors(torch.randn(k, n) * 0.05, group, act_order=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(m, rows).to(device, dtype)
    got = w4a16_matmul(
        x,
        tensors["qweight"][first // 8 : (first + rows) // 8].to(device),
        tensors["qzeros"].to(device),  # every group's
        tensors["scales"].to(device, dtype),
        tensors["g_idx"][first : first + rows].to(device),
        group,
        "gptq",
        zero_offset=1,
    )
    want = x.float() @ meaning[first : first + rows].to(device)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


@pytest.mark.parametrize(
    ("m", "tiles"),
    [
        (3, (16, 32, 1, 4, 2, 2)),  # few rows on the MMA's narrow side, 2 K slices
        (5, (16, 32, 1, 4, 2, 4)),  # 4 slices asked of 3 tiles: 3 launched (k_slices)
        (20, (32, 64, 0, 4, 2, 1)),  # rows as the MMA's tall side
        (40, (16, 32, 1, 4, 1, 0)),  # 3 row tiles, split chosen
        (24, (16, 32, 2, 4, 2, 2)),  # the tile's slices joined into one dot (groups of 128; per slice otherwise)
        (64, (64, 64, 2, 4, 2, 1)),
    ],
)
# 192: a group ends inside a tile of 128; 384: one group over all three tiles, so a K slice starts inside it (on
# CUDA the scales then come a tile ahead from the slice's own group)
@pytest.mark.parametrize("group", [32, 128, 192, 384])
def test_tiled_gemm_orientations_and_splits(device: torch.device, m: int, tiles: Tiles, group: int) -> None:
    torch.manual_seed(2)
    k, n = 384, 96
    weight = torch.randn(k, n) * 0.05
    tensors, meaning = gptq_tensors(weight, group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(m, k).to(device, dtype)
    packed = (
        tile_rows(tensors["qweight"]).to(device),
        tensors["qzeros"].to(device),
        tensors["scales"].to(device, dtype),
    )
    got = w4a16_matmul(x, *packed, None, group, "tiled", zero_offset=1, tiles=tiles)
    want = x.float() @ meaning.to(device)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
    # split-K sums in slice order and leaves every tile's counter at zero: a second call gives the same bits
    assert not reserve_split_counters(x.device).any()
    assert torch.equal(w4a16_matmul(x, *packed, None, group, "tiled", zero_offset=1, tiles=tiles), got)


def test_no_k_slice_starts_past_k() -> None:
    assert k_slices(384, 4, 128) == (3, 128)  # 96 inputs a slice round up to a tile: three slices cover K
    assert k_slices(384, 2, 128) == (2, 256)
    assert k_slices(11008, 8, 128) == (8, 1408)  # the last slice is short, not empty
    assert k_slices(14336, 32, 128) == (28, 512)


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("tiles", [(16, 32, 32, 4, 2, 2), (16, 64, 32, 4, 2, 4), (32, 32, 64, 4, 2, 1)])
def test_w4a16_split_over_k_adds_up(device: torch.device, fmt: str, tiles: Tiles) -> None:
    torch.manual_seed(1)
    k, n, group = 256, 64, 64
    weight = torch.randn(k, n) * 0.05
    tensors, meaning = awq_tensors(weight, group) if fmt == "awq" else gptq_tensors(weight, group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # (CUDA's fp32 tl.dot is TF32)
    x = torch.randn(3, k).to(device, dtype)
    got = w4a16_matmul(
        x,
        tensors["qweight"].to(device),
        tensors["qzeros"].to(device),
        tensors["scales"].to(device, dtype),
        None,
        group,
        fmt,
        zero_offset=1 if fmt == "gptq" else 0,
        tiles=tiles,
    )
    want = x.float() @ meaning.to(device)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


@pytest.mark.parametrize("group", [32, 128])
def test_prefill_rows_dequantise_the_tiled_weight_once(device: torch.device, group: int) -> None:
    """Above DEQUANTIZE_ABOVE_ROWS rows the tiled weight is dequantised (kernel = the torch reference, exactly
    in fp32) and multiplied by cuBLAS / torch."""
    torch.manual_seed(3)
    k, n, m = 256, 80, DEQUANTIZE_ABOVE_ROWS + 9
    tensors, meaning = gptq_tensors(torch.randn(k, n) * 0.05, group)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    qweight, qzeros = tile_rows(tensors["qweight"]).to(device), tensors["qzeros"].to(device)
    scales = tensors["scales"].to(device, dtype)
    weight = dequantize_tiled(qweight, qzeros, scales, group, 1, dtype)
    want_weight = dequantize("tiled", qweight, qzeros, scales.float(), None, group, 1)
    torch.testing.assert_close(weight.float(), want_weight, rtol=0, atol=0 if dtype == torch.float32 else 1e-2)
    x = torch.randn(m, k).to(device, dtype)
    got = w4a16_matmul(x, qweight, qzeros, scales, None, group, "tiled", zero_offset=1)
    want = x.float() @ meaning.to(device)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())
