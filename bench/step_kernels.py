"""Where a step's GPU time goes, kernel by kernel (torch.profiler), on the throughput workload's shapes.

    python3 -m bench.step_kernels [--models smollm2-135m,llama-3.1-8b] [--json out.json]   # CUDA, repo root

For each shape (random bf16 weights), an engine with CUDA graphs off (so the profiler sees every kernel)
runs 256 requests x 512 prompt tokens: the first step (a pure prefill of max_num_batched_tokens) and,
once every sequence decodes, a few decode steps at 256 sequences are profiled. Prints, per step kind,
the kernels that take the most GPU time, grouped by name, with their share of the step.

`--host` also runs the whole workload (256 x 512 x 256) the way bench.throughput does (CUDA graphs,
async steps) under cProfile, and prints each eager step's host and GPU forward time and the functions
that take the most host time: where a host-bound step's milliseconds go.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.throughput import build_models, make_prompts
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config


def kernel_times(prof: Any) -> dict[str, tuple[int, float]]:
    """Kernel name -> (launches, total GPU µs)."""
    table: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = table[event.name[:100]]
            entry[0] += 1
            entry[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    return {k: (int(v[0]), v[1]) for k, v in table.items()}


def profiled(engine: Engine, steps: int) -> dict[str, tuple[int, float]]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return kernel_times(prof)


def show(title: str, table: dict[str, tuple[int, float]], steps: int, top: int) -> dict[str, Any]:
    total = sum(us for _, us in table.values())
    print(
        f"--- {title}: {total / steps / 1e3:.2f} ms GPU per step, {sum(n for n, _ in table.values()) / steps:.0f} "
        f"kernels per step"
    )
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    for name, (n, us) in rows[:top]:
        print(f"  {us / steps:9.1f} µs/step {100 * us / total:5.1f}%  {n // steps:4d} x  {name}")
    kernels = {k: {"launches_per_step": n / steps, "us_per_step": us / steps} for k, (n, us) in rows}
    return {"ms_per_step": total / steps / 1e3, "kernels": kernels}


def engine_config(model_dir: Path, args: argparse.Namespace, **changes: Any) -> Config:
    """The throughput workload's engine on the GPU (bf16, 256 sequences, 8,192-token steps by default)."""
    return Config.of(
        model=str(model_dir),
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
        gpu_memory_utilization=0.85,
        **changes,
    )


def host_profile(model: Any, model_dir: Path, args: argparse.Namespace, top: int) -> dict[str, Any]:
    """The full workload with graphs and async steps, per-step phase times and a cProfile of it."""
    engine = Engine(engine_config(model_dir, args, profile_steps=True), model=model)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(args.num_seqs, args.prompt_len, model.spec.vocab_size, seed=2)):
        engine.add_request(f"h{i}", prompt, params)
    profile = engine.profile
    steps: list[dict[str, Any]] = []
    profiler = cProfile.Profile()
    start = time.perf_counter()
    while engine.has_unfinished():
        before = {kind: dict(phases) for kind, phases in profile.host_s.items()}
        gpu_before = {kind: dict(phases) for kind, phases in profile.gpu_ms.items()}
        step_start = time.perf_counter()
        profiler.enable()
        engine.step()
        profiler.disable()
        wall = time.perf_counter() - step_start
        for kind, phases in profile.host_s.items():
            host = {p: (s - before.get(kind, {}).get(p, 0.0)) * 1e3 for p, s in phases.items()}
            gpu = {p: s - gpu_before.get(kind, {}).get(p, 0.0) for p, s in profile.gpu_ms.get(kind, {}).items()}
            if sum(host.values()) > 0:
                steps.append({"kind": kind, "wall_ms": wall * 1e3, "host_ms": host, "gpu_ms": gpu})
    seconds = time.perf_counter() - start
    eager = [s for s in steps if s["kind"] == "eager"]
    print(
        f"--- host: {len(steps)} engine calls in {seconds:.2f} s ({args.num_seqs * 256 / seconds:,.0f} out tok/s"
        f" under cProfile); eager calls (host forward / GPU forward so far / wall ms):"
    )
    for s in eager[:24]:
        print(
            f"  {s['host_ms'].get('forward', 0):8.2f} {s['gpu_ms'].get('forward', 0):8.2f} {s['wall_ms']:8.2f}"
            f"   {' '.join(f'{k} {v:.2f}' for k, v in s['host_ms'].items())}"
        )
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top * 2)
    print(out.getvalue()[-6000:])
    del engine
    return {"seconds": seconds, "steps": steps, "profile_summary": profile.summary()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--host", action="store_true", help="also profile the host over the whole workload")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    for name in args.models.split(","):
        hf, model, model_dir = build_models(name, 4096)
        del hf
        engine = Engine(engine_config(model_dir, args, cuda_graph_max_batch=0), model=model)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for i, prompt in enumerate(make_prompts(args.num_seqs, args.prompt_len, model.spec.vocab_size, seed=1)):
            engine.add_request(f"r{i}", prompt, params)
        report[name] = {
            "prefill": show(
                f"{name} prefill step ({args.max_num_batched_tokens} tokens)", profiled(engine, 1), 1, args.top
            )
        }
        while engine.stats().num_waiting or engine.scheduler.running[-1].num_computed_tokens < args.prompt_len:
            engine.step()
        for _ in range(3):
            engine.step()
        report[name]["decode"] = show(
            f"{name} decode step ({args.num_seqs} sequences, eager)",
            profiled(engine, args.decode_steps),
            args.decode_steps,
            args.top,
        )
        del engine
        torch.cuda.empty_cache()
        if args.host:
            report[name]["host"] = host_profile(model, model_dir, args, args.top)
        del model
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
