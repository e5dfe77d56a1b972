"""Dense decode GEMV (kernels/gemv.py) vs cuBLAS on the Llama-3.1-8B linears of one rank at TP = 1, 2, 4 (and
SmolLM2's), 1-4 rows, against the weight-read floor.

    python3 -m bench gemv [--json bench/results/gemv.json] [--rows 1,2,4] [--no-sweep]

Per linear and rows M: cuBLAS (`F.linear`), the GEMV with its default tiles and the best of a tile sweep
(BLOCK_N, BLOCK_K, warps, split-K), and for the down projection the SiLU kernel + cuBLAS against the GEMV that
reads silu(gate) * up itself. The floor is the weight bytes / the bandwidth of a 1 GiB device copy. CUDA-graph
timed, each call on the next of enough weight copies to span 256 MiB, so weights come from HBM as in a decode
step (bench/w4a16_gemm.py's method).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from bench.w4a16_gemm import copies, copy_bandwidth, rotated_us
from pagedserve.kernels.gemv import GemvConfig, default_config, gemv
from pagedserve.kernels.silu_mul import silu_mul

HIDDEN, INTERMEDIATE, Q, KV = 4096, 14336, 4096, 1024  # Llama-3.1-8B


def llama_8b(tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear on one of `tp` ranks."""
    return {
        "qkv": ((Q + 2 * KV) // tp, HIDDEN),
        "o": (HIDDEN, Q // tp),
        "gate_up": (2 * INTERMEDIATE // tp, HIDDEN),
        "down": (HIDDEN, INTERMEDIATE // tp),
    }


SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "8b-tp1": llama_8b(1),
    "8b-tp2": llama_8b(2),
    "8b-tp4": llama_8b(4),
    "smollm2": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
}
SWEEP: list[GemvConfig] = [  # (BLOCK_N, BLOCK_K, warps, SPLIT_K; 0 = auto)
    (2, 1024, 4, 0),
    (4, 512, 4, 0),
    (4, 1024, 4, 0),
    (4, 1024, 8, 0),
    (8, 256, 2, 0),
    (8, 512, 4, 0),
    (8, 512, 8, 0),
    (16, 256, 4, 0),
    (16, 512, 8, 0),
    (8, 512, 4, 1),
]


def _timed(call: object, weights: list[tuple[torch.Tensor, ...]]) -> float:
    try:
        return rotated_us(call, weights)  # type: ignore[arg-type]
    except OutOfResources as e:  # a sweep tile too large for this GPU's registers
        print(f"  skipped: {e}", flush=True)
        return float("inf")


def measure(name: str, n: int, k: int, rows: int, bandwidth: float, sweep: bool) -> dict[str, object]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    weights = copies((weight,), rotate=True)
    x = torch.randn((rows, k), device="cuda", dtype=torch.bfloat16, generator=gen)
    want = F.linear(x.float(), weight.float())
    got = gemv(x, weight)
    error = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert error < 2e-2, (name, rows, error)  # bf16 output rounding
    row: dict[str, object] = {"linear": name, "n": n, "k": k, "rows": rows, "max_rel_error": round(error, 5)}
    row["cublas_us"] = _timed(lambda w: F.linear(x, w[0]), weights)
    row["gemv_default_us"] = _timed(lambda w: gemv(x, w[0]), weights)
    row["default_config"] = list(default_config(rows, n, k))
    if sweep:
        timings = {config: _timed(lambda w, c=config: gemv(x, w[0], config=c), weights) for config in SWEEP}
        best = min(timings, key=timings.__getitem__)
        row["gemv_best_us"], row["best_config"] = timings[best], list(best)
        row["sweep_us"] = {",".join(map(str, c)): round(t, 2) for c, t in timings.items()}
    if name == "down":  # the SiLU kernel + cuBLAS vs the GEMV reading silu(gate) * up
        gate_up = torch.randn((rows, 2 * k), device="cuda", dtype=torch.bfloat16, generator=gen)
        row["silu_cublas_us"] = _timed(lambda w: F.linear(silu_mul(gate_up), w[0]), weights)
        row["gemv_silu_us"] = _timed(lambda w: gemv(gate_up, w[0], silu_mul=True), weights)
    floor = n * k * 2 / bandwidth * 1e6
    row["floor_us"] = floor
    for key in ("cublas_us", "gemv_default_us", "gemv_best_us"):
        if key in row:
            row[key.replace("_us", "_of_floor")] = round(floor / float(row[key]), 3)  # type: ignore[arg-type]
    del weights
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--no-sweep", action="store_true", help="cuBLAS and the default tiles only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    header = f"{'shape':<8} {'linear':<8} {'M':>2} {'cuBLAS':>8} {'GEMV':>8} {'best':>8} {'floor':>7}  best config"
    print(header, flush=True)
    for shape in args.shapes.split(","):
        for name, (n, k) in SHAPES[shape].items():
            for rows in rows_list:
                row = {"shape": shape, **measure(name, n, k, rows, bandwidth, not args.no_sweep and rows == 1)}
                results.append(row)
                best = row.get("gemv_best_us", float("nan"))
                print(
                    f"{shape:<8} {name:<8} {rows:>2} {row['cublas_us']:>8.2f} {row['gemv_default_us']:>8.2f} "
                    f"{best:>8.2f} {row['floor_us']:>7.2f}  {row.get('best_config', '')}"
                    + (
                        f"  silu+cuBLAS {row['silu_cublas_us']:.2f} / GEMV(silu) {row['gemv_silu_us']:.2f}"
                        if "gemv_silu_us" in row
                        else ""
                    ),
                    flush=True,
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
            "results": results,
        }
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
