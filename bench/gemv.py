"""Dense decode GEMV (kernels/gemv.py) vs cuBLAS on the Llama-3.1-8B linears of one rank at TP = 1, 2, 4 (and
SmolLM2's), 1-4 rows, against the weight-read floor.

    python3 -m bench gemv [--json bench/results/gemv.json] [--rows 1,2,4] [--no-sweep]

Per linear and rows M: cuBLAS (`F.linear`), the GEMV with its default tiles and (M = 1) the best of a tile
sweep (BLOCK_N, BLOCK_K, warps, split-K), in µs and in TB/s of weight read. CUDA-graph timed, each call on the
next of enough weight copies to span 256 MiB, so weights come from HBM as in a decode step
(bench/w4a16_gemm.py's method).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from bench.w4a16_gemm import copies, rotated_us
from pagedserve.kernels import launch_config
from pagedserve.kernels.gemv import GemvConfig, default_config, gemv, gemv_silu_mul
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
    (1, 512, 2, 0),
    (1, 1024, 4, 0),
    (1, 2048, 8, 0),
    (2, 512, 2, 0),
    (2, 1024, 2, 0),
    (2, 1024, 4, 0),
    (2, 2048, 4, 0),
    (2, 2048, 8, 0),
    (4, 1024, 8, 0),
    (4, 1024, 4, 0),
    (2, 1024, 4, 1),
]


def _timed(call: object, weights: list[tuple[torch.Tensor, ...]]) -> float:
    try:
        return rotated_us(call, weights)  # type: ignore[arg-type]
    except OutOfResources as e:  # a sweep tile too large for this GPU's registers
        print(f"  skipped: {e}", flush=True)
        return float("inf")


def measure(name: str, n: int, k: int, rows: int, sweep: bool) -> dict[str, object]:
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
    if name == "gate_up" and rows == 1:  # the SiLU in the GEMV's epilogue vs the projection, then the SiLU kernel
        row["gate_up_then_silu_us"] = _timed(lambda w: silu_mul(gemv(x, w[0])), weights)
        row["gate_up_silu_us"] = _timed(lambda w: gemv_silu_mul(x, w[0]), weights)
    if sweep:
        timings = {config: _timed(lambda w, c=config: gemv(x, w[0], config=c), weights) for config in SWEEP}
        best = min(timings, key=timings.__getitem__)
        row["gemv_best_us"], row["best_config"] = timings[best], list(best)
        row["sweep_us"] = {",".join(map(str, c)): round(t, 2) for c, t in timings.items()}
    for key in ("cublas_us", "gemv_default_us", "gemv_best_us"):
        if key in row:  # weight bytes read per second
            row[key.replace("_us", "_tb_s")] = round(n * k * 2 / float(row[key]) / 1e6, 3)  # type: ignore[arg-type]
    del weights
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--no-sweep", action="store_true", help="cuBLAS and the default tiles only")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--pdl", action="store_true", help="launch with programmatic dependent launch")
    args = parser.parse_args()
    launch_config.set_pdl(args.pdl)
    print(torch.cuda.get_device_name(), flush=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    header = f"{'shape':<8} {'linear':<8} {'M':>2} {'cuBLAS µs':>9} {'GEMV':>7} {'best':>7} {'TB/s':>17}  best config"
    print(header, flush=True)
    for shape in args.shapes.split(","):
        for name, (n, k) in SHAPES[shape].items():
            for rows in rows_list:
                row = {"shape": shape, **measure(name, n, k, rows, not args.no_sweep and rows == 1)}
                results.append(row)
                best = row.get("gemv_best_us", float("nan"))
                rates = "/".join(f"{row[key]:.2f}" for key in ("cublas_tb_s", "gemv_default_tb_s") if key in row)
                print(
                    f"{shape:<8} {name:<8} {rows:>2} {row['cublas_us']:>9.2f} {row['gemv_default_us']:>7.2f} "
                    f"{best:>7.2f} {rates:>17}  {row.get('best_config', '')}",
                    flush=True,
                )
                if "gate_up_silu_us" in row:
                    print(
                        f"{shape:<8} gate_up then SiLU kernel {row['gate_up_then_silu_us']:.2f} µs, SiLU in the GEMV "
                        f"{row['gate_up_silu_us']:.2f} µs",
                        flush=True,
                    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "pdl": args.pdl,
            "results": results,
        }
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
