"""The custom all-reduce against NCCL on one host's GPUs: correctness, then latency per message size.

    python -m bench.custom_all_reduce                     # 2 GPUs, own spawn
    torchrun --nproc-per-node 2 bench/custom_all_reduce.py
    python -m bench.custom_all_reduce --check-only        # correctness only (tests/engine/..._gpu.py)

Correctness: for each size and dtype (bf16, fp32), ParallelContext.all_reduce (the plan's choice) equals
NCCL's all-reduce and is the same on every rank, eagerly and replayed from a CUDA graph.
Latency: each algorithm forced, 20 all-reduces captured in one CUDA graph (as decode graphs run them),
the graph replayed; microseconds per all-reduce. Columns: NCCL; one-shot (copy kernel + one-shot kernel,
what the engine runs); one-shot with torch's in-kernel copy (one launch; not used, see
custom_all_reduce.SymmMemTransport); two-shot (copy + two-shot kernel). NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, set before init).
Writes custom_all_reduce_<gpu>.json under $OUT if set, else --out-dir (bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedserve.services.engine.parallel import partial_sums
from pagedserve.services.engine.parallel.all_reduce_plan import AllReducePlan
from pagedserve.services.engine.parallel.custom_all_reduce import SymmMemTransport
from pagedserve.services.engine.parallel.state import ParallelContext, init_parallel

SIZES = [2 << 10, 8 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20]
DEFAULT_MAX_BYTES = 8 << 20  # the engine's --custom-all-reduce-max-bytes default
CALLS_PER_GRAPH = 20


def check(ctx: ParallelContext, sizes: list[int]) -> list[dict[str, Any]]:
    """The plan's all-reduce and each forced algorithm against NCCL's, eager and replayed from a CUDA
    graph, on every rank; raises on a mismatch."""
    assert ctx.custom_all_reduce is not None
    transport = ctx.custom_all_reduce.transport
    paths: dict[str, Any] = {"plan": ctx.all_reduce, "one_shot": transport.one_shot_}
    if ctx.world_size in (2, 4, 8):
        paths["two_shot"] = transport.two_shot_
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for nbytes in sizes:
            numel = nbytes // dtype.itemsize
            gen = torch.Generator(device=ctx.device).manual_seed(1000 * ctx.rank + nbytes)
            x = torch.randn(numel // 64, 64, device=ctx.device, dtype=dtype, generator=gen)
            expected = x.clone()
            dist.all_reduce(expected, group=ctx.model_group)
            exact = x.float().clone()  # the sum in fp32 (exact for a few bf16 addends); a copy for fp32 x
            dist.all_reduce(exact, group=ctx.model_group)
            magnitude = x.float().abs()  # sum |x_r|: bounds what each rounding of a partial sum can lose
            dist.all_reduce(magnitude, group=ctx.model_group)
            for path, reduce_ in paths.items():
                eager = x.clone()
                reduce_(eager)
                static = torch.zeros_like(x)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    reduce_(static)
                static.copy_(x)
                graph.replay()
                everyone = [torch.empty_like(eager) for _ in range(ctx.world_size)]
                dist.all_gather(everyone, eager, group=ctx.model_group)
                torch.cuda.synchronize()
                row = {
                    "bytes": nbytes,
                    "dtype": str(dtype).removeprefix("torch."),
                    "path": path,
                    "plan_chose": ctx.custom_all_reduce.plan.choose_for(x).value,
                    "equals_nccl_bitwise": bool(torch.equal(eager, expected)),
                    "graph_equals_eager": bool(torch.equal(static, eager)),
                    "same_on_every_rank": all(torch.equal(everyone[0], e) for e in everyone[1:]),
                }
                # NCCL rounds to the dtype after each of its W-1 adds, so with 3+ ranks its bf16 result can be
                # ulps off where addends cancel. Any summation order is within W-1 roundings of the exact sum,
                # each at most a unit roundoff (2^-8 in bf16, 2^-24 in fp32) of a partial sum <= sum |x_r|.
                unit = 2.0**-24 if dtype == torch.float32 else 2.0**-8
                bound = ctx.world_size * unit * magnitude + 1e-6
                close = bool(((eager.float() - exact).abs() <= bound).all())
                row["max_abs_diff_from_nccl"] = float((eager.float() - expected.float()).abs().max())
                assert close and row["graph_equals_eager"] and row["same_on_every_rank"], row
                rows.append(row)
    return rows


FUSED_CASES = [(1, 4096), (3, 4096), (64, 4096), (257, 4096), (2, 8192), (5, 1000)]  # (rows, hidden)
FUSED_CHAINS = (7, 8)  # finishes per graph (by case, alternately): odd counts end in partial_sums' barrier


def _fused_inputs(
    ctx: ParallelContext, shape: tuple[int, int], dtype: torch.dtype, seed: int, chain: int
) -> tuple[list[list[torch.Tensor]], torch.Tensor, torch.Tensor]:
    """([rank][call] partials, residual, weight): every rank regenerates every rank's, for the reference."""
    gen = torch.Generator(device=ctx.device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=ctx.device, dtype=dtype, generator=gen)

    every = [[randn(*shape) for _ in range(chain)] for _ in range(ctx.world_size)]
    return every, randn(*shape), randn(shape[1])


def _fused_reference(
    every: list[list[torch.Tensor]], residual: torch.Tensor, weight: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The unfused CUDA path: the sum in rank order (fp32, rounded once: NCCL's own result with 2 ranks),
    then the add + RMSNorm kernel the engine runs without the fusion, whose fp32 reduction is the same."""
    from pagedserve.kernels.fused_norm import add_rms_norm_

    res, outs = residual.clone(), []
    for i in range(len(every[0])):
        total = torch.zeros(every[0][i].shape, dtype=torch.float32, device=residual.device)
        for rank_parts in every:
            total += rank_parts[i].float()
        out, res = add_rms_norm_(total.to(residual.dtype), res, weight, 1e-5)
        outs.append(out)
    return outs, res


def _all_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _mismatches(got: list[torch.Tensor], want: list[torch.Tensor]) -> int:
    return sum(int((g != w).sum()) for g, w in zip(got, want, strict=True))


def check_fused_case(
    ctx: ParallelContext, shape: tuple[int, int], dtype: torch.dtype, seed: int, chain: int
) -> dict[str, Any]:
    partials = ctx.partials
    assert partials is not None
    every, residual, weight = _fused_inputs(ctx, shape, dtype, seed, chain)
    res, eager = residual.clone(), []
    with partial_sums.forward_pass():  # as the engine runs a forward: partials alternate buffer halves
        for i in range(chain):
            slot = partials.slot(*shape, dtype)
            slot.copy_(every[ctx.rank][i])  # the projection's write
            out, res = partials.finish_add_rms_norm(slot, res, weight, 1e-5)
            eager.append(out)
    want, want_res = _fused_reference(every, residual, weight)
    eager_ok = _all_equal(eager, want) and torch.equal(res, want_res)
    mismatches = _mismatches(eager, want) + _mismatches([res], [want_res])

    mine = [torch.zeros(shape, device=ctx.device, dtype=dtype) for _ in range(chain)]
    static_res = torch.zeros(shape, device=ctx.device, dtype=dtype)
    graph, graph_outs = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph), partial_sums.forward_pass():
        r = static_res
        for i in range(chain):
            slot = partials.slot(*shape, dtype)
            slot.copy_(mine[i])
            out, r = partials.finish_add_rms_norm(slot, r, weight, 1e-5)
            graph_outs.append(out)
    graph_ok = True
    for replay in range(3):  # new partials and residual each replay (the weight is captured)
        every, residual, _ = _fused_inputs(ctx, shape, dtype, seed + 1 + replay, chain)
        for i in range(chain):
            mine[i].copy_(every[ctx.rank][i])
        static_res.copy_(residual)
        graph.replay()
        want, want_res = _fused_reference(every, residual, weight)
        graph_ok = graph_ok and _all_equal(graph_outs, want) and torch.equal(static_res, want_res)
        mismatches += _mismatches(graph_outs, want) + _mismatches([static_res], [want_res])
    everyone = [torch.empty_like(graph_outs[-1]) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, graph_outs[-1], group=ctx.model_group)
    torch.cuda.synchronize()
    return {
        "rows": shape[0],
        "hidden": shape[1],
        "chain": chain,
        "dtype": str(dtype).removeprefix("torch."),
        "eager_equals_reference": eager_ok,
        "graph_equals_reference": graph_ok,
        "same_on_every_rank": all(torch.equal(everyone[0], e) for e in everyone[1:]),
        "mismatched_elements": mismatches,
    }


def check_fused(ctx: ParallelContext) -> list[dict[str, Any]]:
    """The fused all-reduce + residual add + RMSNorm (partial_sums / kernels/all_reduce_norm.py) against its
    reference on every rank's regenerated partials: eager, then 7 or 8 calls in one CUDA graph
    replayed on new partials (each call's write overwrites the buffer the previous call's peers read)."""
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for case, shape in enumerate(FUSED_CASES):
            row = check_fused_case(ctx, shape, dtype, 100 * case, FUSED_CHAINS[case % 2])
            assert row["eager_equals_reference"] and row["graph_equals_reference"] and row["same_on_every_rank"], row
            rows.append(row)
    return rows


def latency_fused(ctx: ParallelContext, iters: int) -> list[dict[str, Any]]:
    """Microseconds per (all-reduce + residual add + RMSNorm) of a [rows, 4096] bf16 projection output:
    NCCL then the add+norm kernel (the default path), vs the fused kernel on a partial in the buffer."""
    from pagedserve.kernels.fused_norm import add_rms_norm_

    partials = ctx.partials
    assert partials is not None
    weight = torch.randn(4096, device=ctx.device, dtype=torch.bfloat16)
    rows = []
    for num_rows in (1, 8, 64, 256):
        residual = torch.randn(num_rows, 4096, device=ctx.device, dtype=torch.bfloat16)

        def nccl_then_norm(x: torch.Tensor, residual: torch.Tensor = residual) -> None:
            dist.all_reduce(x, group=ctx.model_group)
            add_rms_norm_(x.view(-1, 4096), residual, weight, 1e-5)

        def fused(_: torch.Tensor, residual: torch.Tensor = residual, num_rows: int = num_rows) -> None:
            assert partials is not None  # calls alternate the buffer's halves, as in a forward
            partials.finish_add_rms_norm(partials.slot(num_rows, 4096, torch.bfloat16), residual, weight, 1e-5)

        rows.append(
            {
                "rows": num_rows,
                "bytes": num_rows * 4096 * 2,
                "nccl_plus_norm_us": round(time_graph(ctx, nccl_then_norm, num_rows * 4096, iters), 2),
                "fused_us": round(time_graph(ctx, fused, 16, iters), 2),
            }
        )
    return rows


def time_graph(ctx: ParallelContext, run: Any, numel: int, iters: int) -> float:
    """Microseconds per all-reduce: CALLS_PER_GRAPH calls captured in one graph, replayed `iters` times."""
    x = torch.randn(numel, device=ctx.device, dtype=torch.bfloat16)
    for _ in range(3):
        run(x)  # warm: NCCL's and the kernels' first launches happen outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), partial_sums.forward_pass():  # an even count: no barrier
        for _ in range(CALLS_PER_GRAPH):
            run(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier(group=ctx.step_group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (iters * CALLS_PER_GRAPH)


def latency(ctx: ParallelContext, transport: SymmMemTransport, sizes: list[int], iters: int) -> list[dict[str, Any]]:
    ops = torch.ops.symm_mem

    def nccl(x: torch.Tensor) -> None:
        dist.all_reduce(x, group=ctx.model_group)

    def one_shot_in_kernel_copy(x: torch.Tensor) -> None:
        ops.one_shot_all_reduce_copy_out(transport._slot(x), x, "sum", transport.group_name, x)

    runs: dict[str, Any] = {
        "nccl_us": nccl,
        "one_shot_us": transport.one_shot_,
        "one_shot_in_kernel_copy_us": one_shot_in_kernel_copy,
    }
    if ctx.world_size in (2, 4, 8):
        runs["two_shot_us"] = transport.two_shot_
    default_plan = AllReducePlan.for_world(ctx.world_size, DEFAULT_MAX_BYTES)
    rows = []
    for nbytes in sizes:
        numel = nbytes // 2
        row: dict[str, Any] = {"bytes": nbytes, "default_plan": default_plan.choose(nbytes, torch.bfloat16, 0).value}
        for name, run in runs.items():
            row[name] = round(time_graph(ctx, run, numel, iters), 2)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    columns = [c for c in rows[0] if c.endswith("_us")]
    lines = ["| bytes | default plan | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for r in rows:
        lines.append(f"| {r['bytes']} | {r['default_plan']} | " + " | ".join(str(r[c]) for c in columns) + " |")
    return "\n".join(lines)


def rank_main(rank: int, world_size: int, init_method: str, args: argparse.Namespace) -> None:
    ctx = init_parallel(
        rank, world_size, init_method, torch.device("cuda"), 120.0, args.buffer_bytes, args.buffer_bytes, args.push
    )
    if ctx.custom_all_reduce is None:
        sys.exit("custom all-reduce did not start (see the warning above)")
    if ctx.partials is None:  # asked for (max bytes > 0): its absence is a failure, not a skip
        sys.exit("the fused all-reduce + RMSNorm did not start (see the warning above)")
    result: dict[str, Any] = {"check_fused": check_fused(ctx)}  # the engine's default path first
    result["check"] = check(ctx, [s for s in SIZES if s <= args.buffer_bytes])
    if not args.check_only:
        transport = ctx.custom_all_reduce.transport
        assert isinstance(transport, SymmMemTransport)
        result["latency"] = latency(ctx, transport, [s for s in SIZES if s <= args.buffer_bytes], args.iters)
        result["latency_fused"] = latency_fused(ctx, args.iters)
    if rank == 0:
        bitwise = sum(r["equals_nccl_bitwise"] for r in result["check"])
        print(
            f"check: {len(result['check'])} size/dtype/path cases match NCCL (graph = eager, the same on every"
            f" rank); {bitwise} of them bit for bit"
        )
        print(
            f"fused all-reduce + add + RMSNorm: {len(result['check_fused'])} cases equal the reference bit for"
            " bit, eager and in graphs, the same on every rank"
        )
        if "latency" in result:
            print(table(result["latency"]))
        if "latency_fused" in result:
            print("| rows (x4096 bf16) | NCCL + add/norm µs | fused µs |\n|---|---|---|")
            for r in result["latency_fused"]:
                print(f"| {r['rows']} | {r['nccl_plus_norm_us']} | {r['fused_us']} |")
        write(result, args, world_size)
    dist.barrier(group=ctx.step_group)
    sys.stdout.flush()
    os._exit(0)  # no NCCL teardown (see parallel/state.shutdown_parallel)


def write(result: dict[str, Any], args: argparse.Namespace, world_size: int) -> None:
    device = torch.cuda.get_device_name(0)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "device": device,
        "world_size": world_size,
        "torch": torch.__version__,
        "calls_per_graph": CALLS_PER_GRAPH,
        "fused_protocol": "push" if args.push else "pull",
        **result,
    }
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    protocol = "_push" if args.push else ""
    path = out_dir / f"custom_all_reduce_{device.replace(' ', '_')}_tp{world_size}{protocol}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")


def _spawned(rank: int, world_size: int, init_method: str, args: argparse.Namespace) -> None:
    rank_main(rank, world_size, init_method, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--world-size", type=int, default=2, help="own spawn only (torchrun sets it)")
    parser.add_argument("--buffer-bytes", type=int, default=32 << 20, help="symmetric buffer (largest size run)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--push", action="store_true", help="the fused all-reduce's push protocol (default: pull)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.world_size, f"tcp://127.0.0.1:{port}", args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
