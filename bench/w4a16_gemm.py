"""W4A16 GEMM and decode GEMV (AWQ / GPTQ 4-bit weights) vs bf16 on the Llama-3.1-8B linears, against the floor.

    python3 -m bench w4a16_gemm [--json bench/results/w4a16.json]      # CUDA
    python3 -m bench w4a16_gemm --rows 1,4,8 --gemv-sweep             # the GEMV's tile / split-K sweep only
    python3 -m bench w4a16_gemm --rows 16,64,256 --sweep --formats tiled  # the tiled GEMM's tile sweep

Per linear (qkv, o, gate_up, down) and rows M: the tl.dot GEMM (kernels/w4a16_gemm.py) on GPTQ's K-major
checkpoint layout and on the tiled layout Int4Linear repacks every 4-bit format to at load (`--formats`),
the GEMV (kernels/w4a16_gemv.py, tiled, rows <= 16), bf16 `F.linear` (cuBLAS), and the floor = bytes the
kernel must read (4-bit weights, fp16 scales, packed zeros, activations) / the measured copy bandwidth.
CUDA-graph timed (`do_bench_cudagraph`), each call on the next of enough weight copies to span 256 MiB, so
weights come from HBM as in a decode step
(an H100's L2 holds 50 MB: the o / qkv / down weights would otherwise stay in it between calls);
--l2-resident times one copy, like the 2026-11-25 run in bench/results/w4a16_h100/.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench_cudagraph

from pagedserve.kernels import launch_config, w4a16_gemm
from pagedserve.kernels import w4a16_gemv as gemv_module
from pagedserve.kernels.w4a16_gemm import Tiles, default_tiled_tiles, default_tiles, w4a16_matmul
from pagedserve.kernels.w4a16_gemv import GemvTiles, default_gemv_tiles, w4a16_gemv

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
GROUP = 128
SWEEP: dict[str, list[Tiles]] = {  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K; 0 = auto)
    "decode": [(16, 64, 128, 4, 4, 0), (16, 128, 128, 4, 4, 0), (16, 128, 128, 8, 3, 0)],
    "mid": [(64, 64, 64, 4, 4, 0), (64, 128, 64, 4, 3, 0), (64, 128, 128, 8, 3, 0)],
    "prefill": [(128, 128, 32, 8, 3, 1), (128, 128, 64, 8, 3, 1), (128, 256, 64, 8, 3, 1)],
}
TILED_SWEEP: dict[str, list[Tiles]] = {  # (BLOCK_M, BLOCK_N, SWAP, warps, stages, SPLIT_K; 0 = auto)
    "decode": [
        (16, 128, 1, 4, 3, 0),
        (16, 64, 1, 4, 3, 0),
        (16, 128, 2, 4, 3, 0),
        (16, 64, 2, 4, 3, 0),
        (16, 256, 2, 8, 3, 0),
        (16, 128, 2, 4, 4, 0),
        (16, 128, 2, 4, 2, 0),
        (16, 128, 2, 4, 3, 1),
    ],
    "mid": [
        (64, 128, 1, 4, 3, 0),
        (32, 128, 1, 4, 3, 0),
        (64, 128, 2, 4, 3, 0),
        (64, 128, 2, 4, 3, 1),
        (32, 128, 2, 4, 3, 0),
        (64, 64, 2, 4, 3, 0),
        (64, 128, 2, 8, 3, 0),
        (64, 256, 2, 8, 3, 0),
        (64, 128, 2, 4, 4, 0),
        (64, 128, 2, 4, 2, 0),
        (64, 64, 1, 4, 3, 0),
        (32, 64, 2, 4, 3, 0),
        (64, 64, 2, 4, 4, 0),
        (64, 64, 2, 4, 3, 1),
    ],
    "prefill": [
        (128, 128, 0, 8, 3, 1),
        (128, 256, 0, 8, 3, 1),
        (64, 128, 0, 4, 3, 1),
        (128, 128, 2, 8, 3, 0),
        (128, 128, 2, 8, 3, 1),
        (128, 256, 2, 8, 3, 0),
        (64, 128, 2, 4, 3, 0),
        (64, 128, 2, 4, 3, 1),
    ],
}


GEMV_MAX_ROWS = 16  # timed up to here (Int4Linear uses it up to kernels/w4a16_gemv.MAX_ROWS)
GEMV_SWEEP: list[GemvTiles] = [  # (BLOCK_N, warps, SPLIT_K; 0 = auto)
    (512, 4, 0),
    # the auto split against the others: powers of two, and the splits whose programs all fit on the GPU at once
    # with K slices of equal size (gate_up 7, down 38 at three programs an SM of 132)
    *((512, 4, split) for split in (4, 6, 7, 8, 12, 14, 16, 24, 28, 32, 38, 48, 56, 64)),
    (256, 2, 0),
    *((256, 2, split) for split in (8, 16, 32, 64)),
    (256, 4, 0),
    (1024, 4, 0),
    (1024, 8, 0),
    (128, 1, 0),
]
ROTATE_BYTES = 256 << 20
Weight = tuple[torch.Tensor, ...]


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


def copies(weight: Weight, rotate: bool) -> list[Weight]:
    """The weight and enough clones to span ROTATE_BYTES (just the weight if not `rotate`)."""
    size = sum(t.numel() * t.element_size() for t in weight)
    count = -(-ROTATE_BYTES // size) if rotate else 1
    return [weight] + [tuple(t.clone() for t in weight) for _ in range(count - 1)]


def rotated_us(call: Callable[[Weight], object], weights: list[Weight]) -> float:
    """µs per call, each call (graph-captured) on the next copy."""
    cycle = itertools.cycle(weights)
    return do_bench_cudagraph(lambda: call(next(cycle))) * 1e3


def _time_tiles(x: torch.Tensor, fmt: str, weights: list[Weight], candidates: list[Tiles]) -> dict[Tiles, float]:
    """µs per call of each GEMM tile choice."""

    def timed(tiles: Tiles) -> float:
        try:
            return rotated_us(lambda w: w4a16_matmul(x, w[0], w[1], w[2], None, GROUP, fmt, 1, tiles), weights)
        except OutOfResources as e:  # a sweep tile too large for this GPU's registers / shared memory
            print(f"  {fmt} {tiles}: {e}", flush=True)
            return float("inf")

    return {tiles: timed(tiles) for tiles in candidates}


def _time_gemv(
    x: torch.Tensor, weights: list[Weight], candidates: list[GemvTiles], prefetch: bool | None = None
) -> dict[GemvTiles, float]:
    """µs per call of each GEMV tile choice (K-major weights)."""

    def timed(tiles: GemvTiles) -> float:
        try:
            return rotated_us(lambda w: w4a16_gemv(x, w[0], w[1], w[2], GROUP, 1, tiles, prefetch), weights)
        except OutOfResources as e:  # a sweep tile too large for this GPU's registers / shared memory
            print(f"  gemv {tiles}: {e}", flush=True)
            return float("inf")

    return {tiles: timed(tiles) for tiles in candidates}


def _row_class(rows: int) -> str:
    return "decode" if rows <= 16 else "mid" if rows <= 64 else "prefill"


def measure(rows: int, k: int, n: int, bandwidth: float, args: argparse.Namespace) -> dict[str, object]:
    rotate = not args.l2_resident
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bf16 = copies((torch.randn(n, k, device="cuda", dtype=torch.bfloat16),), rotate)
    result: dict[str, object] = {"bf16_us": rotated_us(lambda w: F.linear(x, w[0]), bf16)}
    del bf16
    for fmt in () if args.gemv_sweep else args.formats.split(","):
        sweep, default = (TILED_SWEEP, default_tiled_tiles(rows, n)) if fmt == "tiled" else (SWEEP, default_tiles(rows))
        candidates = [*sweep[_row_class(rows)], default] if args.sweep else [default]
        candidates = list(dict.fromkeys(candidates))  # the default once, timed beside the sweep
        # random codes are as good a weight in one layout as in another; AWQ's shape differs
        timed = _time_tiles(x, fmt, copies(packed(k, n, fmt), rotate), candidates)
        best = min(timed, key=lambda t: timed[t])
        result[f"{fmt}_us"], result[f"{fmt}_tiles"] = timed[best], list(best)
        result[f"{fmt}_default_us"] = timed.get(default)
        result[f"{fmt}_all_us"] = {",".join(map(str, t)): us for t, us in timed.items()}
        if fmt == "tiled" and not args.sweep:  # the same tiles unpacking in float32 (before the PTX unpacking)
            w4a16_gemm.UNPACK_WITH_ASM = False
            try:
                result["tiled_f32_us"] = _time_tiles(x, fmt, copies(packed(k, n, fmt), rotate), [default])[default]
            finally:
                w4a16_gemm.UNPACK_WITH_ASM = True
    if rows <= GEMV_MAX_ROWS:
        gemv_candidates = GEMV_SWEEP if args.gemv_sweep else [default_gemv_tiles(rows)]
        gemv = _time_gemv(x, copies(packed(k, n, "tiled"), rotate), gemv_candidates)
        best_gemv = min(gemv, key=lambda t: gemv[t])
        result["gemv_us"], result["gemv_tiles"] = gemv[best_gemv], list(best_gemv)
        result["gemv_default_us"] = gemv.get(default_gemv_tiles(rows))
        result["gemv_all_us"] = {",".join(map(str, t)): us for t, us in gemv.items()}
        if args.gemv_prefetch and rows == 1:  # the same tiles with each load issued a step early
            for prefetch in (False, True):
                by_tiles = _time_gemv(x, copies(packed(k, n, "tiled"), rotate), gemv_candidates, prefetch)
                result[f"gemv_prefetch{int(prefetch)}_all_us"] = {
                    ",".join(map(str, t)): us for t, us in by_tiles.items()
                }
                print(f"  {k}x{n} prefetch={prefetch}: " + " ".join(f"{t}:{us:.1f}" for t, us in by_tiles.items()))
    weight_bytes = k * n // 2 + (k // GROUP) * n * 2 + (k // GROUP) * n // 2
    result["floor_us"] = (weight_bytes + rows * (k + n) * 2) / bandwidth * 1e6
    result["bf16_floor_us"] = (k * n * 2 + rows * (k + n) * 2) / bandwidth * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=Path("bench/results/w4a16_gemm.json"))
    parser.add_argument("--rows", default="1,4,8,16,64,256")
    parser.add_argument("--sweep", action="store_true", help="time each GEMM tile candidate, report the best")
    parser.add_argument("--gemv-sweep", action="store_true", help="time each GEMV tile / split candidate, no GEMM")
    parser.add_argument("--formats", default="gptq,tiled", help="GEMM layouts to time: awq, gptq, tiled")
    parser.add_argument("--l2-resident", action="store_true", help="time one weight copy (L2 hits between calls)")
    parser.add_argument("--gemv-prefetch", action="store_true", help="M = 1: each GEMV tile without and with prefetch")
    parser.add_argument("--pdl", action="store_true", help="launch with programmatic dependent launch")
    parser.add_argument("--gemv-rows", type=int, default=gemv_module.GEMV_ROWS, help="packed rows a GEMV load brings")
    parser.add_argument("--once", metavar="ROWS:LINEAR", help="3 calls of the served kernel: ncu profiles the 3rd")
    args = parser.parse_args()
    if not set(args.formats.split(",")) <= {"awq", "gptq", "tiled"}:
        parser.error(f"--formats takes awq, gptq and tiled, not {args.formats}")
    launch_config.set_pdl(args.pdl)
    gemv_module.GEMV_ROWS = args.gemv_rows
    if args.once:
        rows, name = args.once.split(":")
        call_once(int(rows), *SHAPES[name])
        return
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; µs per call; floor = bytes / copy rate")
    formats = ("awq", "gptq", "tiled_f32", "tiled", "gemv")
    print(
        f"{'M':>5} {'linear':>8} {'bf16':>8} " + " ".join(f"{f:>8}" for f in formats) + f" {'floor':>8} "
        f"{'best/floor':>10} {'vs bf16':>8}  best of the served kernels (tiled GEMM, GEMV); their tiles"
    )
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in SHAPES.items():
            r = measure(rows, k, n, bandwidth, args)
            results.append({"rows": rows, "linear": name, "k": k, "n": n, **r})
            ours = {f: float(r[f"{f}_us"]) for f in formats if f"{f}_us" in r}  # type: ignore[arg-type]
            served = [ours[f] for f in ("tiled", "gemv") if f in ours]
            best, floor, bf16 = min(served), float(r["floor_us"]), float(r["bf16_us"])  # type: ignore[arg-type]
            cells = " ".join(f"{ours[f]:8.1f}" if f in ours else f"{'-':>8}" for f in formats)
            print(
                f"{rows:5d} {name:>8} {bf16:8.1f} {cells} {floor:8.1f} {floor / best:10.0%} {bf16 / best:7.2f}x  "
                f"{r.get('tiled_tiles', '')} {r.get('gemv_tiles', '')}",
                flush=True,
            )
            if args.sweep and "tiled_all_us" in r:
                timed = cast(dict[str, float], r["tiled_all_us"])
                print("  " + " ".join(f"[{t}] {us:.1f}" for t, us in timed.items()), flush=True)
            write_json(args, bandwidth, results)  # after every row: a sweep cut short keeps what it timed


def call_once(rows: int, k: int, n: int) -> None:
    """Three calls of the kernel Int4Linear serves `rows` rows with (default tiles), eager: `ncu --launch-skip 2
    --launch-count 1` profiles the third."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    qweight, qzeros, scales = packed(k, n, "tiled")
    for _ in range(3):
        if rows <= gemv_module.MAX_ROWS:  # as Int4Linear chooses
            w4a16_gemv(x, qweight, qzeros, scales, GROUP, 1)
        else:
            w4a16_matmul(x, qweight, qzeros, scales, None, GROUP, "tiled", 1)
    torch.cuda.synchronize()


def write_json(args: argparse.Namespace, bandwidth: float, results: list[dict[str, object]]) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "copy_bytes_per_s": bandwidth,
                "group_size": GROUP,
                "weights_rotated": not args.l2_resident,
                "pdl": args.pdl,
                "gemv_rows": args.gemv_rows,
                "results": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
