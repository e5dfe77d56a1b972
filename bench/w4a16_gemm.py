"""W4A16 GEMM (AWQ / GPTQ 4-bit weights) vs bf16 on the Llama-3.1-8B linears, against the weight-read floor.

    python3 -m bench w4a16_gemm [--json bench/results/w4a16.json]      # CUDA

Per linear (qkv, o, gate_up, down) and rows M: our Triton kernel (kernels/w4a16_gemm.py) on AWQ and GPTQ
layouts, bf16 `F.linear` (cuBLAS), and the floor = bytes the kernel must read (4-bit weights, fp16 scales,
packed zeros, activations) / the measured copy bandwidth. CUDA-graph timed (`do_bench_cudagraph`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from pagedserve.kernels.w4a16_gemm import Tiles, default_tiles, w4a16_matmul

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
GROUP = 128
SWEEP: dict[str, list[Tiles]] = {  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K; 0 = auto)
    "decode": [
        (16, 64, 128, 4, 4, 0),
        (16, 32, 128, 4, 4, 0),
        (16, 128, 128, 4, 4, 0),
        (16, 64, 64, 4, 4, 0),
        (16, 64, 128, 4, 4, 1),
        (16, 128, 128, 8, 3, 0),
        (16, 256, 64, 8, 3, 0),
    ],
    "mid": [
        (64, 64, 64, 4, 4, 0),
        (64, 128, 64, 4, 3, 0),
        (64, 128, 128, 8, 3, 0),
        (32, 128, 128, 4, 3, 0),
        (64, 64, 128, 4, 4, 1),
    ],
    "prefill": [
        (128, 128, 32, 8, 3, 1),
        (128, 128, 64, 8, 3, 1),
        (128, 256, 64, 8, 3, 1),
        (64, 128, 64, 4, 4, 1),
        (128, 64, 64, 4, 4, 1),
    ],
}


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench_cudagraph(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def packed(k: int, n: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (k, n // 8) if fmt == "awq" else (k // 8, n)
    qweight = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device="cuda", generator=gen)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (k // GROUP, n // 8), dtype=torch.int32, device="cuda", generator=gen)
    scales = torch.rand((k // GROUP, n), dtype=torch.bfloat16, device="cuda", generator=gen) * 0.01
    return qweight, qzeros, scales


def _time_tiles(
    x: torch.Tensor, fmt: str, weight: tuple[torch.Tensor, torch.Tensor, torch.Tensor], candidates: list[Tiles]
) -> dict[Tiles, float]:
    """µs per call of each tile choice."""
    qweight, qzeros, scales = weight
    return {
        tiles: do_bench_cudagraph(lambda t=tiles: w4a16_matmul(x, qweight, qzeros, scales, None, GROUP, fmt, 1, t))
        * 1e3
        for tiles in candidates
    }


def _row_class(rows: int) -> str:
    return "decode" if rows <= 16 else "mid" if rows <= 64 else "prefill"


def measure(rows: int, k: int, n: int, bandwidth: float, sweep: bool) -> dict[str, object]:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    result: dict[str, object] = {"bf16_us": do_bench_cudagraph(lambda: F.linear(x, w)) * 1e3}
    for fmt in ("awq", "gptq"):
        candidates = SWEEP[_row_class(rows)] if sweep else [default_tiles(rows)]
        timed = _time_tiles(x, fmt, packed(k, n, fmt), candidates)
        best = min(timed, key=lambda t: timed[t])
        result[f"{fmt}_us"], result[f"{fmt}_tiles"] = timed[best], list(best)
        result[f"{fmt}_default_us"] = timed.get(default_tiles(rows))
    weight_bytes = k * n // 2 + (k // GROUP) * n * 2 + (k // GROUP) * n // 2
    result["floor_us"] = (weight_bytes + rows * (k + n) * 2) / bandwidth * 1e6
    result["bf16_floor_us"] = (k * n * 2 + rows * (k + n) * 2) / bandwidth * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("bench/results/w4a16_gemm.json"))
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--sweep", action="store_true", help="time each tile candidate, report the best")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; µs per call; floor = bytes / copy rate")
    print(
        f"{'M':>5} {'linear':>8} {'bf16':>8} {'awq':>8} {'gptq':>8} {'floor':>8} {'awq/floor':>9} {'vs bf16':>8}"
        "  best awq tiles"
    )
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in SHAPES.items():
            r = measure(rows, k, n, bandwidth, args.sweep)
            results.append({"rows": rows, "linear": name, "k": k, "n": n, **r})
            awq, floor, bf16 = float(r["awq_us"]), float(r["floor_us"]), float(r["bf16_us"])  # type: ignore[arg-type]
            print(
                f"{rows:5d} {name:>8} {bf16:8.1f} {awq:8.1f} {float(r['gptq_us']):8.1f} "  # type: ignore[arg-type]
                f"{floor:8.1f} {floor / awq:8.0%} {bf16 / awq:7.2f}x  {r['awq_tiles']}",
                flush=True,
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "copy_bytes_per_s": bandwidth,
                "group_size": GROUP,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
