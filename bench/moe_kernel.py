"""Fused-MoE kernel on the Qwen3-30B-A3B layer shape: correctness, time, and % of its weight-read floor.

    python -m bench moe_kernel [--sweep] [--json bench/results/moe_kernel_h100.json]      # CUDA
    python -m bench moe_kernel --mxfp4                                                   # CUDA: gpt-oss MXFP4
    TRITON_INTERPRET=1 python -m bench moe_kernel --quick [--mxfp4] --json /tmp/moe_quick.json   # any CPU: tiny

Per batch of tokens (1, 16, 64, 256), random bf16 weights and router logits (softmax top-8, renormalized
as Qwen3-MoE's norm_topk_prob): our kernel (kernels/fused_moe.py, CUDA-graph timed) against the torch
reference (kernels/moe_reference.py, the CPU path: its max |error| relative to the output's max, and its
time), and the floor = bytes of the experts the batch actually hit (w13 + w2 of each) plus activations /
the measured copy bandwidth. `--sweep` times candidate configs per batch and prints a MOE_TUNED entry
for kernels/launch_config.py.

`--mxfp4`: gpt-oss-20b's and gpt-oss-120b's expert layers (32 or 128 experts, top-4, hidden = intermediate
= 2880, swigluoai with biases) with random MXFP4 weights (codes and scales drawn directly: no 4-bit rounding
of a dense tensor to wait for), the kernel dequantising in registers against the same kernel on the
dequantised bf16 weights; the floor counts the 4-bit bytes hit (codes + one scale byte per 32 + biases).

`--fp8` / `--w4a16`: the Qwen3-30B-A3B layer with its experts quantized (kernels/expert_quant.py's layouts:
fp8 e4m3 with a scale per output channel; int4 codes with a bf16 scale and a uint8 zero point per group of
`--group-size` 128), bf16 activations, against the same kernel on the dequantised bf16 experts; the floor
counts the quantized bytes hit (codes, scales, zero points) and %floor of the bf16 run counts its 16-bit bytes.

    python -m bench moe_kernel --fp8 | --w4a16 [--sweep]                                    # CUDA
    TRITON_INTERPRET=1 python -m bench moe_kernel --quick --w4a16 --json /tmp/moe_quick.json   # any CPU: tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

from pagedserve.kernels import expert_quant
from pagedserve.kernels.fused_moe import TRITON_ALIGN_MAX_ASSIGNMENTS, fused_experts
from pagedserve.kernels.launch_config import MoeConfig, choose_moe_config
from pagedserve.kernels.moe_align import moe_align_block_size
from pagedserve.kernels.moe_align_triton import moe_align_block_size_triton
from pagedserve.kernels.moe_reference import experts_grouped
from pagedserve.services.engine.models import mxfp4
from pagedserve.services.engine.models.moe import route

QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)
QUICK = dict(num_experts=8, top_k=2, hidden=64, intermediate=32)
GPT_OSS = {
    "gpt-oss-20b": dict(num_experts=32, top_k=4, hidden=2880, intermediate=2880),
    "gpt-oss-120b": dict(num_experts=128, top_k=4, hidden=2880, intermediate=2880),
}
QUICK_MXFP4 = {"quick": dict(num_experts=8, top_k=2, hidden=64, intermediate=64)}
SWIGLU = dict(activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=7.0)  # gpt-oss's


def sweep_candidates() -> list[MoeConfig]:
    """Row blocks x output tiles x K tiles x warps (3 stages; 64-row blocks grouped 8 for L2 reuse), and
    large tiles for prefill-sized batches."""
    return (
        [
            MoeConfig(bm, bn, bk, 8 if bm == 64 else 1, warps, 3)
            for bm, bn, bk, warps in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8))
        ]
        + [MoeConfig(128, 128, 64, 8, 8, stages) for stages in (3, 4)]
        + [MoeConfig(64, 128, 64, 8, 8, 4)]
    )


def time_us(fn: Callable[[], object], cuda: bool, graph: bool = True) -> float:
    if cuda:
        from triton.testing import do_bench, do_bench_cudagraph

        return float(do_bench_cudagraph(fn) if graph else do_bench(fn)) * 1e3
    fn()  # the interpreter: one warm-up, one wall-clock run (checks the plumbing, not speed)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device copy (read + write counted): 1 GiB on CUDA, 64 MiB elsewhere."""
    src = torch.empty(1 << (30 if device.type == "cuda" else 26), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        from triton.testing import do_bench_cudagraph

        seconds = float(do_bench_cudagraph(lambda: dst.copy_(src))) * 1e-3
    else:
        dst.copy_(src)
        start = time.perf_counter()
        dst.copy_(src)
        seconds = time.perf_counter() - start
    return 2 * src.numel() / seconds


def measure(
    num_tokens: int, shape: dict[str, int], dtype: torch.dtype, device: torch.device, bandwidth: float, sweep: bool
) -> dict[str, object]:
    num_experts, top_k, hidden, intermediate = (shape[k] for k in ("num_experts", "top_k", "hidden", "intermediate"))
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device=device, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, device=device, generator=gen) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, device=device, generator=gen) * intermediate**-0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, device=device, generator=gen)
    weights, ids = route(logits, top_k, "softmax", renormalize=True)
    cuda = device.type == "cuda"
    out = fused_experts(x, w13, w2, weights, ids)
    ref = experts_grouped(x, w13, w2, weights, ids)
    exact = experts_grouped(x.float(), w13.float(), w2.float(), weights, ids)  # fp32 all through

    def rel_error(y: torch.Tensor, target: torch.Tensor) -> float:
        return float((y.float() - target).abs().max() / target.abs().max())

    default = choose_moe_config(num_tokens=num_tokens, dtype=str(dtype).removeprefix("torch."), **shape)
    timed = {default: time_us(lambda: fused_experts(x, w13, w2, weights, ids, config=default), cuda)}
    if sweep:
        for config in sweep_candidates()[: 3 if device.type == "cpu" else None]:  # the interpreter: a taste
            try:
                timed[config] = time_us(partial(fused_experts, x, w13, w2, weights, ids, config=config), cuda)
            except Exception as exc:  # a tiling that does not fit (shared memory, registers) on this GPU
                print(f"  skip {config}: {type(exc).__name__}")
    best = min(timed, key=lambda c: timed[c])
    use_torch_align = num_tokens == 1 or num_tokens * top_k > TRITON_ALIGN_MAX_ASSIGNMENTS  # as fused_experts
    align = moe_align_block_size if use_torch_align else moe_align_block_size_triton
    hit = int(ids.unique().numel())
    weight_bytes = hit * 3 * hidden * intermediate * w13.element_size()
    activation_bytes = (2 * num_tokens * hidden + 2 * num_tokens * top_k * (intermediate + hidden)) * x.element_size()
    floor_us = (weight_bytes + activation_bytes) / bandwidth * 1e6
    return {
        "num_tokens": num_tokens,
        "experts_hit": hit,
        "max_rel_error": rel_error(out, ref.float()),  # kernel vs the torch path in the same dtype
        "kernel_vs_fp32": rel_error(out, exact),
        "torch_vs_fp32": rel_error(ref, exact),
        "align_us": time_us(lambda: align(ids, default.block_m, num_experts), cuda),  # the one fused_experts runs
        "align_torch_us": time_us(lambda: moe_align_block_size(ids, default.block_m, num_experts), cuda),
        "align_triton_us": time_us(lambda: moe_align_block_size_triton(ids, default.block_m, num_experts), cuda),
        "kernel_us": timed[default],
        "default_config": list(astuple(default)),
        "best_us": timed[best],
        "best_config": list(astuple(best)),
        # the torch path reads per-expert counts on the host: no graph, so launch gaps count too
        "torch_reference_us": time_us(lambda: experts_grouped(x, w13, w2, weights, ids), cuda, graph=False),
        "floor_us": floor_us,
        "floor_fraction": floor_us / timed[default],
    }


@dataclass
class Mxfp4Layer:
    """One gpt-oss expert layer: packed codes/scales, the same weights dequantised, and biases."""

    w13: torch.Tensor  # [E, 2I, hidden / 2] uint8
    w13_scale: torch.Tensor  # [E, 2I, hidden / 32] uint8
    w2: torch.Tensor  # [E, hidden, I / 2] uint8
    w2_scale: torch.Tensor  # [E, hidden, I / 32] uint8
    w13_dense: torch.Tensor  # [E, 2I, hidden] in the activation dtype
    w2_dense: torch.Tensor  # [E, hidden, I]
    biases: dict[str, torch.Tensor]  # w13_bias, w2_bias

    def packed_bytes_per_expert(self) -> int:
        tensors = (self.w13, self.w13_scale, self.w2, self.w2_scale, *self.biases.values())
        return sum(t[0].numel() * t.element_size() for t in tensors)


def random_mxfp4_layer(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Mxfp4Layer:
    """mxfp4.random_flat's codes and scales; dequantised one expert at a time (the whole-tensor path would
    hold ~17 GB of int64 indices for gpt-oss-120b)."""
    num_experts, hidden, intermediate = shape["num_experts"], shape["hidden"], shape["intermediate"]
    gen = torch.Generator(device=device).manual_seed(0)

    def codes(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = mxfp4.random_flat((num_experts, rows, cols // 2), False, gen)
        return packed, mxfp4.random_flat((num_experts, rows, cols // mxfp4.BLOCK), True, gen)

    def dense(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        out = torch.empty(*packed.shape[:2], 2 * packed.shape[2], dtype=dtype, device=device)
        for e in range(num_experts):
            out[e] = mxfp4.dequantize_flat(packed[e], scales[e], dtype)
        return out

    (w13, w13_scale), (w2, w2_scale) = codes(2 * intermediate, hidden), codes(hidden, intermediate)
    biases = {
        "w13_bias": (torch.randn(num_experts, 2 * intermediate, device=device, generator=gen) * 0.1).to(dtype),
        "w2_bias": (torch.randn(num_experts, hidden, device=device, generator=gen) * 0.1).to(dtype),
    }
    return Mxfp4Layer(w13, w13_scale, w2, w2_scale, dense(w13, w13_scale), dense(w2, w2_scale), biases)


def fp32_on_hit_experts(layer: Mxfp4Layer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The torch reference in fp32 on only the experts hit (ids relabelled), so 120b's fp32 copy stays small."""
    hit = ids.unique()
    local_ids = torch.searchsorted(hit, ids)
    w13, w2 = layer.w13_dense[hit].float(), layer.w2_dense[hit].float()
    biases = {name: b[hit].float() for name, b in layer.biases.items()}
    return experts_grouped(x.float(), w13, w2, weights, local_ids, **biases, **SWIGLU)  # type: ignore[arg-type]


def measure_mxfp4(
    num_tokens: int, shape: dict[str, int], layer: Mxfp4Layer, device: torch.device, bandwidth: float, sweep: bool
) -> dict[str, object]:
    num_experts, top_k, hidden, intermediate = (shape[k] for k in ("num_experts", "top_k", "hidden", "intermediate"))
    dtype = layer.w13_dense.dtype
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device=device, generator=gen).to(dtype)
    weights, ids = route(torch.randn(num_tokens, num_experts, device=device, generator=gen), top_k, "softmax", True)
    cuda = device.type == "cuda"
    scales = dict(w13_scale=layer.w13_scale, w2_scale=layer.w2_scale)

    def packed(config: MoeConfig | None = None) -> torch.Tensor:
        return fused_experts(x, layer.w13, layer.w2, weights, ids, **scales, **layer.biases, **SWIGLU, config=config)  # type: ignore[arg-type]

    def dense() -> torch.Tensor:
        return fused_experts(x, layer.w13_dense, layer.w2_dense, weights, ids, **layer.biases, **SWIGLU)  # type: ignore[arg-type]

    out, out_dense, exact = packed(), dense(), fp32_on_hit_experts(layer, x, weights, ids)

    def rel_error(y: torch.Tensor, target: torch.Tensor) -> float:
        return float((y.float() - target.float()).abs().max() / target.float().abs().max())

    dtype_key = str(dtype).removeprefix("torch.") + "+mxfp4"
    default = choose_moe_config(num_tokens=num_tokens, dtype=dtype_key, **shape)
    timed = {default: time_us(packed, cuda)}
    if sweep:
        for config in sweep_candidates()[: 3 if device.type == "cpu" else None]:
            try:
                timed[config] = time_us(partial(packed, config), cuda)
            except Exception as exc:  # a tiling that does not fit this GPU
                print(f"  skip {config}: {type(exc).__name__}")
    best = min(timed, key=lambda c: timed[c])
    hit = int(ids.unique().numel())
    activation_bytes = (2 * num_tokens * hidden + 2 * num_tokens * top_k * (intermediate + hidden)) * x.element_size()
    floor_us = (hit * layer.packed_bytes_per_expert() + activation_bytes) / bandwidth * 1e6
    dense_bytes = hit * 3 * hidden * intermediate * x.element_size()
    dense_us = time_us(dense, cuda)
    return {
        "num_tokens": num_tokens,
        "experts_hit": hit,
        "max_rel_error": rel_error(out, out_dense),  # the same kernel on the exactly dequantised weights
        "kernel_vs_fp32": rel_error(out, exact),
        "kernel_us": timed[default],
        "default_config": list(astuple(default)),
        "best_us": timed[best],
        "best_config": list(astuple(best)),
        "floor_us": floor_us,
        "floor_fraction": floor_us / timed[default],
        "dense_kernel_us": dense_us,
        "dense_floor_fraction": (dense_bytes + activation_bytes) / bandwidth * 1e6 / dense_us,
    }


def run_mxfp4(args: argparse.Namespace, device: torch.device, bandwidth: float) -> dict[str, object]:
    shapes, dtype = (QUICK_MXFP4, torch.float32) if args.quick else (GPT_OSS, torch.bfloat16)
    print(
        f"{'shape':>12} {'tokens':>6} {'hit':>4} {'mxfp4':>9} {'floor':>8} {'%floor':>7} {'bf16':>9} {'%floor':>7} "
        f"{'err/bf16':>8} {'err/fp32':>8}  best config"
    )
    results = []
    for name, shape in shapes.items():
        layer = random_mxfp4_layer(shape, dtype, device)
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            r = {"shape": name, **measure_mxfp4(num_tokens, shape, layer, device, bandwidth, args.sweep)}
            results.append(r)
            print(
                f"{name:>12} {num_tokens:6d} {r['experts_hit']:4d} {r['kernel_us']:9.1f} {r['floor_us']:8.1f} "
                f"{r['floor_fraction']:7.0%} {r['dense_kernel_us']:9.1f} {r['dense_floor_fraction']:7.0%} "
                f"{r['max_rel_error']:8.1e} {r['kernel_vs_fp32']:8.1e}  {r['best_config']} ({r['best_us']:.1f} µs)",
                flush=True,
            )
        if args.sweep:
            key = (*(shape[k] for k in ("num_experts", "top_k", "hidden", "intermediate")), f"{str(dtype)[6:]}+mxfp4")
            rows = [r for r in results if r["shape"] == name]
            entries = ", ".join(f"({r['num_tokens']}, MoeConfig(*{tuple(r['best_config'])}))" for r in rows)  # type: ignore[arg-type]
            print(f"MOE_TUNED[{key}] = ({entries},)")
        del layer
    return {"variant": "mxfp4", "shapes": shapes, "dtype": str(dtype), "results": results}


@dataclass
class QuantLayer:
    """One expert layer quantized (fp8 or int4) and the same weights dequantised to the activation dtype."""

    w13: torch.Tensor
    w2: torch.Tensor
    quant: dict[str, torch.Tensor]  # w13_scale, w2_scale (and int4's w13_zeros, w2_zeros)
    w13_dense: torch.Tensor
    w2_dense: torch.Tensor

    def bytes_per_expert(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.w13, self.w2, *self.quant.values()))


def random_quant_layer(
    fmt: str, shape: dict[str, int], dtype: torch.dtype, device: torch.device, group: int
) -> QuantLayer:
    """Random weights quantized one expert at a time (a whole-layer fp32 copy would be ~1.6 GB)."""
    num_experts, hidden, intermediate = shape["num_experts"], shape["hidden"], shape["intermediate"]
    gen = torch.Generator(device=device).manual_seed(0)
    parts: dict[str, list[torch.Tensor]] = {}
    for _ in range(num_experts):
        for name, (rows, cols) in (("w13", (2 * intermediate, hidden)), ("w2", (hidden, intermediate))):
            w = (torch.randn(rows, cols, device=device, generator=gen) * cols**-0.5).to(dtype)
            q = expert_quant.quantize_fp8(w) if fmt == "fp8" else expert_quant.quantize_int4(w, group)
            keys = (name, f"{name}_scale", f"{name}_zeros")[: len(q)]
            for key, t in zip(keys, q, strict=True):
                parts.setdefault(key, []).append(t)
    stacked = {key: torch.stack(ts) for key, ts in parts.items()}
    w13, w2 = stacked.pop("w13"), stacked.pop("w2")
    dense = [
        expert_quant.dequantize(w, stacked[f"{n}_scale"], stacked.get(f"{n}_zeros"), dtype)
        for n, w in (("w13", w13), ("w2", w2))
    ]
    return QuantLayer(w13, w2, stacked, *dense)


def measure_quant(
    fmt: str,
    num_tokens: int,
    shape: dict[str, int],
    layer: QuantLayer,
    device: torch.device,
    bandwidth: float,
    sweep: bool,
) -> dict[str, object]:
    num_experts, top_k, hidden, intermediate = (shape[k] for k in ("num_experts", "top_k", "hidden", "intermediate"))
    dtype = layer.w13_dense.dtype
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, device=device, generator=gen).to(dtype)
    weights, ids = route(torch.randn(num_tokens, num_experts, device=device, generator=gen), top_k, "softmax", True)
    cuda = device.type == "cuda"

    def quantized(config: MoeConfig | None = None) -> torch.Tensor:
        return fused_experts(x, layer.w13, layer.w2, weights, ids, **layer.quant, config=config)  # type: ignore[arg-type]

    def dense() -> torch.Tensor:
        return fused_experts(x, layer.w13_dense, layer.w2_dense, weights, ids)

    out, out_dense = quantized(), dense()
    rel_error = float((out.float() - out_dense.float()).abs().max() / out_dense.float().abs().max())
    default = choose_moe_config(num_tokens=num_tokens, dtype=f"{str(dtype).removeprefix('torch.')}+{fmt}", **shape)
    timed = {default: time_us(quantized, cuda)}
    if sweep:
        for config in sweep_candidates()[: 3 if device.type == "cpu" else None]:
            try:
                timed[config] = time_us(partial(quantized, config), cuda)
            except Exception as exc:  # a tiling that does not fit this GPU
                print(f"  skip {config}: {type(exc).__name__}")
    best = min(timed, key=lambda c: timed[c])
    hit = int(ids.unique().numel())
    activation_bytes = (2 * num_tokens * hidden + 2 * num_tokens * top_k * (intermediate + hidden)) * x.element_size()
    floor_us = (hit * layer.bytes_per_expert() + activation_bytes) / bandwidth * 1e6
    dense_floor_us = (hit * 3 * hidden * intermediate * x.element_size() + activation_bytes) / bandwidth * 1e6
    dense_us = time_us(dense, cuda)
    return {
        "num_tokens": num_tokens,
        "experts_hit": hit,
        "max_rel_error": rel_error,  # the same kernel on the exactly dequantised weights
        "kernel_us": timed[default],
        "default_config": list(astuple(default)),
        "best_us": timed[best],
        "best_config": list(astuple(best)),
        "floor_us": floor_us,
        "floor_fraction": floor_us / timed[default],
        "dense_kernel_us": dense_us,
        "dense_floor_fraction": dense_floor_us / dense_us,
        "speedup_vs_dense": dense_us / timed[default],
    }


def run_quant(fmt: str, args: argparse.Namespace, device: torch.device, bandwidth: float) -> dict[str, object]:
    shape, dtype = (QUICK, torch.float32) if args.quick else (QWEN3_30B_A3B, torch.bfloat16)
    group = min(args.group_size, shape["intermediate"])
    layer = random_quant_layer(fmt, shape, dtype, device, group)
    print(
        f"{'tokens':>6} {'hit':>4} {fmt:>9} {'floor':>8} {'%floor':>7} {'bf16':>9} {'%floor':>7} {'speedup':>7} "
        f"{'err/bf16':>8}  best config"
    )
    results = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        r = measure_quant(fmt, num_tokens, shape, layer, device, bandwidth, args.sweep)
        results.append(r)
        print(
            f"{num_tokens:6d} {r['experts_hit']:4d} {r['kernel_us']:9.1f} {r['floor_us']:8.1f} "
            f"{r['floor_fraction']:7.0%} "
            f"{r['dense_kernel_us']:9.1f} {r['dense_floor_fraction']:7.0%} {r['speedup_vs_dense']:7.2f} "
            f"{r['max_rel_error']:8.1e}  {r['best_config']} ({r['best_us']:.1f} µs)",
            flush=True,
        )
    if args.sweep:
        key = (*(shape[k] for k in ("num_experts", "top_k", "hidden", "intermediate")), f"{str(dtype)[6:]}+{fmt}")
        entries = ", ".join(f"({r['num_tokens']}, MoeConfig(*{tuple(r['best_config'])}))" for r in results)  # type: ignore[arg-type]
        print(f"MOE_TUNED[{key}] = ({entries},)")
    return {
        "variant": fmt,
        "shape": shape,
        "dtype": str(dtype),
        "group_size": group if fmt == "int4" else None,
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="default: bench/results/moe_kernel_<device>.json")
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--sweep", action="store_true", help="time candidate configs per batch, print the best")
    parser.add_argument("--quick", action="store_true", help="tiny fp32 shapes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument(
        "--mxfp4", action="store_true", help="gpt-oss-20b/120b expert layers with MXFP4 weights (kernel dequantises)"
    )
    parser.add_argument("--fp8", action="store_true", help="Qwen3-30B-A3B experts in fp8 (per-channel scales)")
    parser.add_argument("--w4a16", action="store_true", help="Qwen3-30B-A3B experts in int4 (group scales, zeros)")
    parser.add_argument("--group-size", type=int, default=128, help="--w4a16's group size along K")
    args = parser.parse_args()
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    if args.mxfp4:
        main_mxfp4(args, device)
        return
    if args.fp8 or args.w4a16:
        main_quant("fp8" if args.fp8 else "int4", args, device)
        return
    shape, dtype = (QUICK, torch.float32) if args.quick else (QWEN3_30B_A3B, torch.bfloat16)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    bandwidth = copy_bandwidth(device)
    print(f"{name}: {shape}, {dtype}; copy {bandwidth / 1e9:.0f} GB/s; µs per call; floor = bytes hit / copy rate")
    print(
        f"{'tokens':>6} {'hit':>4} {'kernel':>9} {'align':>6} {'floor':>8} {'%floor':>7} {'torch':>9} "
        f"{'err/torch':>9} {'err/fp32':>8} {'torch/fp32':>10}  best config"
    )
    results = []
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        r = measure(num_tokens, shape, dtype, device, bandwidth, args.sweep)
        results.append(r)
        print(
            f"{num_tokens:6d} {r['experts_hit']:4d} {r['kernel_us']:9.1f} {r['align_us']:6.1f} {r['floor_us']:8.1f} "
            f"{r['floor_fraction']:7.0%} {r['torch_reference_us']:9.1f} {r['max_rel_error']:9.1e} "
            f"{r['kernel_vs_fp32']:8.1e} {r['torch_vs_fp32']:10.1e}  "
            f"{r['best_config']} ({r['best_us']:.1f} µs)",
            flush=True,
        )
    if args.sweep:
        key = (shape["num_experts"], shape["top_k"], shape["hidden"], shape["intermediate"], str(dtype)[6:])
        entries = ", ".join(f"({r['num_tokens']}, MoeConfig(*{tuple(r['best_config'])}))" for r in results)  # type: ignore[arg-type]
        print(f"MOE_TUNED[{key}] = ({entries},)")
    path = args.json or Path(f"bench/results/moe_kernel_{name.split()[-1].lower()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "device": name,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench moe_kernel", *sys.argv[1:]]),
        "shape": shape,
        "dtype": str(dtype),
        "copy_bytes_per_s": bandwidth,
        "results": results,
    }
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


def main_mxfp4(args: argparse.Namespace, device: torch.device) -> None:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    bandwidth = copy_bandwidth(device)
    print(f"{name}: MXFP4 experts; copy {bandwidth / 1e9:.0f} GB/s; µs per call; floor = bytes hit / copy rate")
    record = run_mxfp4(args, device, bandwidth)
    path = args.json or Path(f"bench/results/moe_kernel_mxfp4_{name.split()[-1].lower()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "device": name,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench moe_kernel", *sys.argv[1:]]),
        "copy_bytes_per_s": bandwidth,
        **record,
    }
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


def main_quant(fmt: str, args: argparse.Namespace, device: torch.device) -> None:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    bandwidth = copy_bandwidth(device)
    print(f"{name}: {fmt} experts; copy {bandwidth / 1e9:.0f} GB/s; µs per call; floor = bytes hit / copy rate")
    record = run_quant(fmt, args, device, bandwidth)
    path = args.json or Path(f"bench/results/moe_kernel_{fmt}_{name.split()[-1].lower()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "device": name,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench moe_kernel", *sys.argv[1:]]),
        "copy_bytes_per_s": bandwidth,
        **record,
    }
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
