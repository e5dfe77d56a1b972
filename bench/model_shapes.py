"""Offline throughput of the issue-20/21 model shapes, random weights, and the KV cache each run gets.

Shapes (bench/shape_configs.py): qwen3-30b-a3b (one H200), gpt-oss-20b bf16 (one H100), gemma-3-12b (one
H100), mixtral-8x7b (two GPUs, --tensor-parallel-size 2), llama-3.1-8b and -70b (the quantization shapes).
Each run writes a config-only model directory, and the engine makes random weights at load (load_format
random), so no checkpoint is written. `--quantization gptq|awq` writes a 4-bit quantization_config (group
128) into it and `fp8` asks for online fp8: the random weights are then made in that format's own layout
(parallel/loading.random_quantized), so a 70B shape in 4 bits loads on one GPU. Per model:
  run     each --batches size in turn (default: --num-requests) of requests x 512 random prompt tokens x 256
          output tokens, greedy, ignore_eos, through Engine.step: output and total tok/s, mean step time, the
          decode (CUDA graph) step's host / GPU ms, preemptions, the most sequences running at once
  kv      what the cache got: pool blocks, layers per block, GiB per GPU, the longest context one sequence
          fits, and how many sequences of the workload's full length fit at once
and for a model whose layers mix sliding and global attention (Gemma 3, gpt-oss) the same cache sized again
with window freeing off (--disable-hybrid-kv-cache-manager): a probe of its capacity (--hybrid-off run: the
workload too). Each run is its own process (fresh GPU memory, its own process group). Gemma 3's window (1024)
is longer than the workload's sequences (768 tokens), so there freeing changes the longest context, not how many
workload sequences fit; gpt-oss's (128) is shorter.

    python -m bench model_shapes --models qwen3-30b-a3b                         # one H200
    python -m bench model_shapes --models gpt-oss-20b,gemma-3-12b               # one H100
    python -m bench model_shapes --models mixtral-8x7b --tensor-parallel-size 2 # two GPUs
    python -m bench model_shapes --models llama-3.1-8b --quantization gptq --batches 1,64,256
    python -m bench model_shapes --tiny --device cpu --in-process               # the CPU smoke run
Prints a markdown table last; writes --json (default bench/results/model_shapes_<device>[_tiny].json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.serve.random_model import add_tokenizer
from bench.shape_configs import SHAPES, tiny_config
from bench.step_kernels import kernel_times
from bench.tensor_parallel import make_prompts, sync
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.kv_cache_groups import blocks_for_context, is_hybrid, max_context, num_cache_tensors
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

INT4_GROUP, TINY_INT4_GROUP = 128, 32  # tiny shapes' MoE intermediate (32) must split into groups


def quantization_config(method: str, group_size: int) -> dict[str, Any]:
    """A 4-bit checkpoint's quantization_config as AutoGPTQ / AutoAWQ write it."""
    if method == "gptq":
        return dict(quant_method="gptq", bits=4, group_size=group_size, desc_act=False, sym=True)
    return dict(quant_method="awq", bits=4, group_size=group_size, zero_point=True, version="gemm")


def write_model_dir(name: str, tiny: bool, tokenizer_dir: Path | None, quantization: str = "none") -> Path:
    """config.json (and generation_config.json); SmolLM2's tokenizer padded to the vocabulary if asked for
    (offline runs take token ids and need none; `pagedserve serve` on the directory would)."""
    cfg = tiny_config(SHAPES[name]) if tiny else SHAPES[name]
    if quantization in ("gptq", "awq"):
        cfg = {**cfg, "quantization_config": quantization_config(quantization, TINY_INT4_GROUP if tiny else INT4_GROUP)}
    model_dir = Path(tempfile.mkdtemp(prefix=f"pagedserve-shape-{name}-"))
    (model_dir / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    eos = {key: cfg[key] for key in ("bos_token_id", "eos_token_id") if key in cfg}
    (model_dir / "generation_config.json").write_text(json.dumps(eos))
    if tokenizer_dir is not None:
        add_tokenizer(model_dir, tokenizer_dir, int(cfg["vocab_size"]))
    return model_dir


def engine_config(model_dir: Path, args: argparse.Namespace, hybrid: bool, warm_up: bool) -> Config:
    return Config.of(
        model=str(model_dir),
        dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
        load_format="random",
        quantization="fp8" if args.quantization == "fp8" else None,  # 4-bit: the config.json says so
        tensor_parallel_size=args.tensor_parallel_size,
        custom_all_reduce_max_bytes=args.custom_all_reduce_max_bytes,
        **(
            {}
            if args.fused_all_reduce_max_bytes is None
            else {"fused_all_reduce_max_bytes": args.fused_all_reduce_max_bytes}
        ),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_bytes=args.cpu_kv_cache_mib << 20,
        disable_hybrid_kv_cache_manager=not hybrid,
        profile_steps=True,
        **({} if args.gemv_max_rows is None else {"gemv_max_rows": args.gemv_max_rows}),
        **({} if args.pdl is None else {"pdl": bool(args.pdl)}),
        warm_up=warm_up,
    )


def kv_capacity(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """The cache this engine got (rank 0's: every rank agrees on the block count)."""
    runner, block_size = engine.runner, engine.config.cache.block_size
    groups, num_blocks = runner.kv_groups, runner.num_blocks
    num_layers = sum(len(g.layers) for g in groups)
    seq_len = args.prompt_len + args.output_len
    tensors = {t.data_ptr(): t for t in runner.kv_caches}  # a hybrid cache's groups share tensors
    return {
        "kv_blocks": num_blocks,
        "block_size": block_size,
        "layers_per_block": num_cache_tensors(groups) if is_hybrid(groups) else num_layers,
        "num_layers": num_layers,
        "kv_groups": [f"{'full' if g.window is None else f'window {g.window}'} x{len(g.layers)}" for g in groups],
        "kv_gib_per_gpu": round(sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30, 2),
        "max_seq_tokens": max_context(groups, num_blocks, block_size, args.max_num_batched_tokens),
        # sequences of the workload's final length, all decoding (a prefill chunk would hold a little more)
        "workload_seqs_fit": num_blocks // blocks_for_context(groups, seq_len, block_size, 1),
    }


def run_workload(engine: Engine, args: argparse.Namespace, num_requests: int) -> dict[str, Any]:
    prompts = make_prompts(num_requests, args.prompt_len, engine.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine.profile.reset()
    first = engine.stats()
    start = sync(args.device)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    num_output, max_running, peak_used = 0, 0, 0
    while engine.has_unfinished():
        num_output += sum(len(out.new_token_ids) for out in engine.step())
        stats = engine.stats()
        max_running = max(max_running, stats.num_running)
        peak_used = max(peak_used, stats.num_total_blocks - stats.num_free_blocks)
    seconds = sync(args.device) - start
    assert num_output == num_requests * args.output_len, num_output
    steps = stats.num_steps - first.num_steps
    profile = engine.profile.summary()
    graph = profile.get("graph")
    profiled = args.kernel_profile and args.device == "cuda"
    return {
        "batch": num_requests,
        "output_tokens": num_output,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(num_output / seconds, 1),
        "total_tokens_per_s": round((num_output + sum(map(len, prompts))) / seconds, 1),
        "steps": steps,
        "mean_step_ms": round(1e3 * seconds / steps, 2),
        "decode_step_host_ms": graph["host_total_ms"] if graph else None,
        "decode_step_gpu_ms": round(sum(graph["gpu_ms"].values()), 3) if graph else None,
        "preemptions": stats.num_preemptions - first.num_preemptions,
        "max_running": max_running,
        "peak_used_blocks": peak_used,
        "profile_per_step": profile,
        "kernels_per_step": profile_kernels(engine, prompts, params, args.kernel_profile) if profiled else None,
    }


def profile_kernels(engine: Engine, prompts: list[list[int]], params: SamplingParams, num_steps: int) -> Any:
    """The same batch again, with torch.profiler over `num_steps` decode steps, then aborted: a pass of its own,
    because starting and reading the profiler takes a few hundred ms that the timed run must not count."""
    ids = [f"p{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    for _ in range(PROFILE_AFTER_STEPS):
        engine.step()
    profiler = start_kernel_profile()
    for _ in range(num_steps):
        engine.step()
    kernels = stop_kernel_profile(profiler, num_steps)
    engine.abort(ids)
    while engine.has_unfinished():
        engine.step()
    return kernels


PROFILE_AFTER_STEPS = 32  # --kernel-profile starts here: every request of a batch is decoding by then


def start_kernel_profile() -> Any:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    profiler = profile(activities=[ProfilerActivity.CUDA])
    profiler.start()
    return profiler


def stop_kernel_profile(profiler: Any, num_steps: int, top: int = 12) -> dict[str, Any]:
    """GPU time per step of the costliest kernels (by name), and of all kernels: where a step's time goes."""
    torch.cuda.synchronize()
    profiler.stop()
    totals = kernel_times(profiler)  # name -> (launches, GPU µs)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])
    return {
        "steps": num_steps,
        "gpu_us": round(sum(us for _, us in totals.values()) / num_steps, 1),
        "kernels": round(sum(n for n, _ in totals.values()) / num_steps, 1),
        "top": [
            {"name": name, "us": round(us / num_steps, 1), "count": round(n / num_steps, 1)}
            for name, (n, us) in ranked[:top]
        ],
    }


def run_one(name: str, window_freeing: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One engine: its cache, and the workload unless this is the window-freeing-off probe."""
    model_dir = write_model_dir(name, args.tiny, args.tokenizer_dir, args.quantization)
    is_probe = not window_freeing and args.hybrid_off == "probe"
    start = sync(args.device)
    engine = Engine(engine_config(model_dir, args, window_freeing, warm_up=not is_probe))
    try:
        row: dict[str, Any] = {
            "model": name,
            "quantization": args.quantization,
            "tensor_parallel_size": args.tensor_parallel_size,
            "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "window_freeing": window_freeing,
            "startup_s": round(sync(args.device) - start, 1),
            "is_hybrid": is_hybrid(engine.runner.kv_groups),  # sliding layers in blocks of their own
            **kv_capacity(engine, args),
        }
        if not is_probe:
            row["workloads"] = [run_workload(engine, args, batch) for batch in args.batches]
        if args.device == "cuda":
            row["peak_allocated_gib_rank0"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    finally:
        engine.shutdown()
    return row


def run_in_child(name: str, window_freeing: bool, args: argparse.Namespace, work_dir: Path) -> dict[str, Any]:
    tag = f"{name}-{'on' if window_freeing else 'off'}"
    command = [sys.executable, "-m", "bench.model_shapes", *args.argv, "--run-one", tag, "--work-dir", str(work_dir)]
    try:
        code = subprocess.run(command, env=os.environ.copy(), timeout=args.run_timeout_s).returncode
    except subprocess.TimeoutExpired:
        code = -1
    path = work_dir / f"{tag}.json"
    if code != 0 or not path.exists():
        return {"model": name, "window_freeing": window_freeing, "error": f"exit {code}"}
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def run_model(name: str, args: argparse.Namespace, work_dir: Path) -> list[dict[str, Any]]:
    """The model's run, then (a hybrid cache only) its cache with window freeing off."""

    def run(window_freeing: bool) -> dict[str, Any]:
        if args.in_process:
            return run_one(name, window_freeing, args)
        return run_in_child(name, window_freeing, args, work_dir)

    print(f"== {name}", flush=True)
    rows = [run(True)]
    if rows[0].get("is_hybrid") and args.hybrid_off != "skip":
        print(f"== {name}, window freeing off ({args.hybrid_off})", flush=True)
        rows.append(run(False))
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "workloads"}), flush=True)
        for work in row.get("workloads", []):
            print(json.dumps({k: v for k, v in work.items() if k != "profile_per_step"}), flush=True)
    return rows


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, int | float) else str(value)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | weights | TP | window freeing | batch | out tok/s | total tok/s | mean step ms "
        "| decode step host / GPU ms | preemptions | max running | KV blocks x layers | KV GiB/GPU "
        "| one seq max tokens | workload seqs fit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | - | - | - | - | {row['error']} |" + " - |" * 9)
            continue
        for work in row.get("workloads") or [{}]:
            lines.append(_table_line(row, work))
    return "\n".join(lines) + "\n"


def _table_line(row: dict[str, Any], work: dict[str, Any]) -> str:
    freeing = "off" if not row["window_freeing"] else "on" if row["is_hybrid"] else "-"
    decode = f"{_cell(work.get('decode_step_host_ms'))} / {_cell(work.get('decode_step_gpu_ms'))}"
    cells = [
        row["model"],
        row.get("quantization", "none"),
        row["tensor_parallel_size"],
        freeing,
        work.get("batch"),
        work.get("output_tokens_per_s"),
        work.get("total_tokens_per_s"),
        work.get("mean_step_ms"),
        decode if work else None,
        work.get("preemptions"),
        work.get("max_running"),
        f"{row['kv_blocks']:,} x {row['layers_per_block']}",
        row["kv_gib_per_gpu"],
        row["max_seq_tokens"],
        row["workload_seqs_fit"],
    ]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument(
        "--custom-all-reduce-max-bytes", type=int, default=0, help="the engine's flag (TP: torch's symm-mem kernels)"
    )
    parser.add_argument("--gemv-max-rows", type=int, help="the engine's flag (default: the engine's); 0: cuBLAS only")
    parser.add_argument(
        "--w4a16-prefetch", type=int, choices=(0, 1), help="the one-row W4A16 GEMV's PREFETCH (default: the kernel's)"
    )
    parser.add_argument("--pdl", type=int, choices=(0, 1), help="programmatic dependent launch (default: the engine's)")
    parser.add_argument("--fused-all-reduce-max-bytes", type=int, help="the engine's flag (TP; default: the engine's)")
    parser.add_argument("--kernel-profile", type=int, default=0, help="CUDA: profile this many decode steps")
    parser.add_argument("--batches", help="comma-separated request counts, run in turn (default: --num-requests)")
    parser.add_argument(
        "--quantization",
        choices=("none", "fp8", "gptq", "awq"),
        default="none",
        help="weights: bf16, online fp8, or a 4-bit checkpoint's layout (random codes)",
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--hybrid-off",
        choices=("probe", "run", "skip"),
        default="probe",
        help="window freeing off, for hybrid models: size the cache only (probe), run the workload too, or skip",
    )
    parser.add_argument("--tiny", action="store_true", help="every shape scaled down (bench/shape_configs.py)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cpu-kv-cache-mib", type=int, default=64, help="KV cache on CPU")
    parser.add_argument("--tokenizer-dir", type=Path, help="SmolLM2's tokenizer files, copied into the model dirs")
    parser.add_argument("--in-process", action="store_true", help="every run in this process (CPU, tests)")
    parser.add_argument("--run-timeout-s", type=float, default=560, help="a run's process is killed after this")
    parser.add_argument("--json", type=Path, help="default bench/results/model_shapes_<device>[_tiny].json")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)  # internal: MODEL-on|off in this process
    parser.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # a run's own process gets the same arguments
    args.batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.num_requests]
    if max(args.batches) > args.max_num_seqs:
        parser.error(f"--batches {max(args.batches)} exceeds --max-num-seqs {args.max_num_seqs}")
    unknown = set(args.models.split(",")) - set(SHAPES)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; known: {', '.join(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on the lent machines
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.w4a16_prefetch is not None:  # a kernel constant, set in this process (and each child's)
        from pagedserve.kernels import w4a16_gemv

        w4a16_gemv.PREFETCH = bool(args.w4a16_prefetch)
    if args.run_one:  # a child: one run, its JSON into the work dir
        name, mode = args.run_one.rsplit("-", 1)
        result = run_one(name, mode == "on", args)
        (args.work_dir / f"{args.run_one}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # no NCCL teardown at exit (see parallel/state.shutdown_parallel)
    work_dir = Path(tempfile.mkdtemp(prefix="pagedserve-shapes-"))
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m bench model_shapes " + " ".join(args.argv),
        "torch": torch.__version__,
        "workload": {k: getattr(args, k) for k in ("batches", "prompt_len", "output_len", "tiny", "quantization")},
        "runs": [],
    }
    for name in args.models.split(","):
        report["runs"] += run_model(name, args, work_dir)
        # the runs name the device: this process never touches the GPU, so each run gets all of its memory
        report["device"] = next((r["device"] for r in report["runs"] if "device" in r), args.device)
        stem = f"model_shapes_{report['device'].split()[-1].lower()}{'_tiny' if args.tiny else ''}"
        path = args.json or Path(__file__).parent / "results" / f"{stem}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))  # a later model's failure keeps the earlier rows
    print(f"\n`{report['command']}` on {report['device']}, {report['date']}\n")
    print(table(report["runs"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
