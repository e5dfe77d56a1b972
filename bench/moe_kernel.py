"""Fused-MoE kernel on the Qwen3-30B-A3B layer shape: correctness, time, and % of its weight-read floor.

    python -m bench moe_kernel [--sweep] [--json bench/results/moe_kernel_h100.json]      # CUDA
    TRITON_INTERPRET=1 python -m bench moe_kernel --quick --json /tmp/moe_quick.json     # any CPU: tiny shapes

Per batch of tokens (1, 16, 64, 256), random bf16 weights and router logits (softmax top-8, renormalized
as Qwen3-MoE's norm_topk_prob): our kernel (kernels/fused_moe.py, CUDA-graph timed) against the torch
reference (kernels/moe_reference.py, the CPU path: its max |error| relative to the output's max, and its
time), and the floor = bytes of the experts the batch actually hit (w13 + w2 of each) plus activations /
the measured copy bandwidth. `--sweep` times candidate configs per batch and prints a MOE_TUNED entry
for kernels/launch_config.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import astuple
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch

from pagedserve.kernels.fused_moe import TRITON_ALIGN_MAX_ASSIGNMENTS, fused_experts
from pagedserve.kernels.launch_config import MoeConfig, choose_moe_config
from pagedserve.kernels.moe_align import moe_align_block_size
from pagedserve.kernels.moe_align_triton import moe_align_block_size_triton
from pagedserve.kernels.moe_reference import experts_grouped
from pagedserve.services.engine.models.moe import route

QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden=2048, intermediate=768)
QUICK = dict(num_experts=8, top_k=2, hidden=64, intermediate=32)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None, help="default: bench/results/moe_kernel_<device>.json")
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--sweep", action="store_true", help="time candidate configs per batch, print the best")
    parser.add_argument("--quick", action="store_true", help="tiny fp32 shapes on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
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


if __name__ == "__main__":
    main()
