"""The decode W4A16 GEMV vs x @ W for the W the GPTQ tensors mean (tests/models/int4_checkpoints.py), on the
tiled layout they are repacked to (models/int4_repack.tile_rows): 1-8 rows, ragged N, group sizes 32/64/128,
asymmetric and symmetric zeros, split-K, and the layouts that reach it through the
load-time repack (AWQ, GPTQ act order), where the tl.dot GEMM reads the repacked layout too.
fp16/bf16 on CUDA, fp32 in the interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.w4a16_gemm import w4a16_matmul
from pagedserve.kernels.w4a16_gemv import GemvTiles, reserve_split_counters, w4a16_gemv
from pagedserve.services.engine.models.int4 import Int4Linear
from pagedserve.services.engine.models.int4_repack import tile_rows
from tests.models.int4_checkpoints import awq_tensors, gptq_tensors, pack_columns, pack_rows


def _symmetric_gptq(weight: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ v1 `sym=True`: every zero point 8 (stored as 7), scale = max |w| / 7 per group."""
    k, n = weight.shape
    scales = (weight.view(k // group, group, n).abs().amax(1) / 7).clamp(min=1e-6).half()
    groups = torch.arange(k) // group
    q = (torch.round(weight / scales[groups].float()) + 8).clamp(0, 15).to(torch.int64)
    zeros = torch.full((k // group, n), 8, dtype=torch.int64)
    tensors = {"qweight": pack_rows(q), "qzeros": pack_columns(zeros - 1), "scales": scales}
    return tensors, (q - 8).float() * scales[groups].float()


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    tolerance = 2e-2 if got.dtype in (torch.bfloat16, torch.float16) else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(
    ("m", "k", "n", "group", "tiles"),
    [
        (1, 384, 200, 128, None),  # three groups, a ragged last n-tile
        (3, 256, 72, 32, (32, 4, 2)),  # 2 slices of 4 groups each
        (8, 384, 136, 128, (64, 4, 3)),  # 3 slices of one tile
        (5, 128, 40, 32, (64, 2, 4)),  # more slices asked than tiles: the one with inputs runs
        (1, 512, 64, 64, (32, 1, 2)),  # groups of two slices of 16
        (1, 384, 72, 192, (64, 2, 3)),  # a group ends inside a tile
    ],
)
def test_gemv_matches_the_dequantized_weight(
    device: torch.device, symmetric: bool, m: int, k: int, n: int, group: int, tiles: GemvTiles | None
) -> None:
    torch.manual_seed(0)
    weight = torch.randn(k, n) * 0.05
    tensors, meaning = _symmetric_gptq(weight, group) if symmetric else gptq_tensors(weight, group)
    dtype = _dtype(device)
    x = torch.randn(m, k).to(device, dtype)
    got = w4a16_gemv(
        x,
        tile_rows(tensors["qweight"]).to(device),
        tensors["qzeros"].to(device),
        tensors["scales"].to(device, dtype),
        group,
        zero_offset=1,
        tiles=tiles,
    )
    assert got.shape == (m, n) and got.dtype == dtype
    _check(got, x.float() @ meaning.to(device))


@pytest.mark.parametrize(
    ("k", "n", "group", "tiles"),
    [
        (384, 200, 128, None),  # three tiles: six steps, a ragged last n-tile
        (512, 64, 64, (32, 1, 2)),  # 2 slices: each walks only its own steps; groups of two slices of 16
        (384, 72, 192, (64, 2, 3)),  # a group ends inside a tile
        (384, 40, 128, (64, 2, 5)),  # 5 slices asked over 3 tiles: 3 run, one tile each
    ],
)
def test_prefetching_gemv_equals_the_plain_loop(
    device: torch.device, k: int, n: int, group: int, tiles: GemvTiles | None
) -> None:
    """One row with each load issued a step early (`_prefetched_row`): the dequantized product, as close to it
    as the plain loop."""
    torch.manual_seed(2)
    weight = torch.randn(k, n) * 0.05
    tensors, meaning = gptq_tensors(weight, group)
    dtype = _dtype(device)
    x = torch.randn(1, k).to(device, dtype)
    packed = (
        tile_rows(tensors["qweight"]).to(device),
        tensors["qzeros"].to(device),
        tensors["scales"].to(device, dtype),
    )
    got = w4a16_gemv(x, *packed, group, zero_offset=1, tiles=tiles, prefetch=True)
    plain = w4a16_gemv(x, *packed, group, zero_offset=1, tiles=tiles, prefetch=False)
    want = x.double() @ meaning.to(device).double()
    _check(got, want.float())
    # fp32 sums taken per step instead of per tile round differently (the codes' bias, up to 2048, leaves in
    # them), and bf16 outputs may then round to a neighbour: no worse than the plain loop, within rounding
    error, plain_error = ((got.double() - want).abs().max().item(), (plain.double() - want).abs().max().item())
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-23
    assert error <= 2 * plain_error + 4 * ulp * want.abs().max().item(), (error, plain_error)


def test_gemv_in_half_precision(device: torch.device) -> None:
    """fp16 activations and scales (the checkpoints' scale dtype), fp32 accumulation."""
    if device.type != "cuda":
        pytest.skip("fp16 arithmetic in the interpreter is numpy's: covered compiled on CUDA")
    torch.manual_seed(2)
    weight = torch.randn(512, 256) * 0.05
    tensors, meaning = gptq_tensors(weight, 128)
    x = torch.randn(4, 512).to(device, torch.float16)
    qweight, qzeros, scales = (tensors[t].to(device) for t in ("qweight", "qzeros", "scales"))
    got = w4a16_gemv(x, tile_rows(qweight), qzeros, scales, 128, zero_offset=1)
    _check(got, x.float() @ meaning.to(device))


@pytest.mark.parametrize(("fmt", "act_order"), [("awq", False), ("gptq", True)])
def test_repacked_layers_feed_the_gemv_and_the_gemm(device: torch.device, fmt: str, act_order: bool) -> None:
    """AWQ's column packing and act order's scattered groups become the plain K-major layout at load, exactly;
    the GEMV (on the gathered x for act order) and the GEMM then read it."""
    torch.manual_seed(3)
    k, n, group = 256, 48, 64
    weight = torch.randn(k, n) * 0.05
    tensors, meaning = awq_tensors(weight, group) if fmt == "awq" else gptq_tensors(weight, group, act_order, seed=5)
    dtype = _dtype(device)
    layer = Int4Linear(k, n, False, dtype, fmt, group, zero_offset=1 if fmt == "gptq" else 0).to(device)
    for name, tensor in tensors.items():
        layer.load_weight(name, tensor.to(device), None)
    layer.finish_loading()
    assert layer.packed_fmt == "tiled" and layer.act_order is None and layer.qweight.shape == (k // 8, n)
    assert (layer.input_perm is not None) == act_order
    # exact in fp32; in fp16 (CUDA) the layer's scales are rounded before (q - z) * s: up to 2^-10 apart (H100)
    atol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(layer.dequantized().float(), meaning.to(device, dtype).float(), rtol=0, atol=atol)
    x = torch.randn(3, k).to(device, dtype)
    x_stored = x if layer.input_perm is None else x.index_select(1, layer.input_perm)
    packed = (layer.qweight.data, layer.qzeros.data, layer.scales.data)
    want = x.float() @ meaning.to(device)
    _check(w4a16_gemv(x_stored, *packed, group, layer.zero_offset, tiles=(32, 4, 2)), want)
    _check(w4a16_matmul(x_stored, *packed, None, group, "tiled", layer.zero_offset), want)


def test_split_k_counters_reset_between_calls(device: torch.device) -> None:
    """The last K slice of each column tile sums the partials and zeroes the tile's counter, so calls of other
    shapes and repeats of the same one (as a CUDA graph replays it) give the same deterministic output."""
    torch.manual_seed(4)
    dtype = _dtype(device)
    weight = torch.randn(256, 96) * 0.05
    tensors, meaning = gptq_tensors(weight, 32)
    qweight, qzeros, scales = tile_rows(tensors["qweight"]).to(device), tensors["qzeros"].to(device), tensors["scales"]
    scales = scales.to(device, dtype)
    x = torch.randn(1, 256).to(device, dtype)
    tiles: GemvTiles = (32, 4, 2)  # 3 column tiles x 2 slices
    first = w4a16_gemv(x, qweight, qzeros, scales, 32, zero_offset=1, tiles=tiles)
    half = (x[:, :128].contiguous(), qweight[:16].contiguous(), qzeros[:4].contiguous(), scales[:4].contiguous())
    other = w4a16_gemv(*half, 32, zero_offset=1, tiles=(32, 4, 1))  # the first 128 inputs (one tile)
    again = w4a16_gemv(x, qweight, qzeros, scales, 32, zero_offset=1, tiles=tiles)
    assert torch.equal(first, again)
    assert not reserve_split_counters(x.device).any()
    _check(first, x.float() @ meaning.to(device))
    _check(other, x[:, :128].float() @ meaning[:128].to(device))
