"""Where a step's GPU time goes, kernel by kernel (torch.profiler), on the throughput workload's shapes.

    python3 -m bench.step_kernels [--models smollm2-135m,llama-3.1-8b] [--json out.json]   # CUDA, repo root

For each shape (random bf16 weights), an engine with CUDA graphs off (so the profiler sees every kernel)
runs 256 requests x 512 prompt tokens: the first step (a pure prefill of max_num_batched_tokens) and,
once every sequence decodes, a few decode steps at 256 sequences are profiled. Prints, per step kind,
the kernels that take the most GPU time, grouped by name, with their share of the step.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.throughput import build_models, make_prompts
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams


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
    print(f"--- {title}: {total / steps / 1e3:.2f} ms GPU per step, {sum(n for n, _ in table.values()) / steps:.0f} "
          f"kernels per step")  # fmt: skip
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])
    for name, (n, us) in rows[:top]:
        print(f"  {us / steps:9.1f} µs/step {100 * us / total:5.1f}%  {n // steps:4d} x  {name}")
    kernels = {k: {"launches_per_step": n / steps, "us_per_step": us / steps} for k, (n, us) in rows}
    return {"ms_per_step": total / steps / 1e3, "kernels": kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    for name in args.models.split(","):
        hf, model, model_dir = build_models(name, 4096)
        del hf
        config = EngineConfig(model_dir=model_dir, dtype="bfloat16", device="cuda", max_num_seqs=args.num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=4096,
                              cuda_graph_max_batch=0, gpu_memory_utilization=0.85)  # fmt: skip
        engine = Engine(config, model=model)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for i, prompt in enumerate(make_prompts(args.num_seqs, args.prompt_len, model.spec.vocab_size, seed=1)):
            engine.add_request(f"r{i}", prompt, params)
        report[name] = {"prefill": show(f"{name} prefill step ({args.max_num_batched_tokens} tokens)",
                                        profiled(engine, 1), 1, args.top)}  # fmt: skip
        while engine.stats().num_waiting or engine.scheduler.running[-1].num_computed_tokens < args.prompt_len:
            engine.step()
        for _ in range(3):
            engine.step()
        report[name]["decode"] = show(f"{name} decode step ({args.num_seqs} sequences, eager)",
                                      profiled(engine, args.decode_steps), args.decode_steps, args.top)  # fmt: skip
        del engine, model
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
