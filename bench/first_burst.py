"""A fresh engine's first burst against the same burst again (issue 23): what the first one pays once.

The offline engine (in this process) runs three bursts of `--requests` random prompts at once, one after the
other, and prints for each its time, every step's wall time up to --show-steps, when its requests got their
first tokens, and the step profile (host phases, GPU forward). A first burst slower than the next points at
work the engine does lazily (memory, kernels loaded at first launch); its host `forward` near its GPU
`forward` means the host waited for the device inside that phase.

    python -m bench.first_burst --shape smollm2-135m [--json out.json]     # CUDA; random weights
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench import throughput
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams


def run_burst(engine: Engine, prompts: list[list[int]], output_len: int, name: str) -> dict[str, Any]:
    """Every prompt at once, stepped to the end: the burst's time, each step's wall time, first-token times."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt, params)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    engine.profile.reset()
    start = last = time.perf_counter()
    steps_ms: list[float] = []
    first_token_s: dict[str, float] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        steps_ms.append(round((now - last) * 1e3, 2))
        last = now
        for out in outputs:
            if out.new_token_ids:
                first_token_s.setdefault(out.request_id, now - start)
    seconds = last - start
    firsts = sorted(first_token_s.values())
    return {
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(len(prompts) * output_len / seconds, 1),
        "steps": len(steps_ms),
        "steps_ms": steps_ms,
        "first_token_ms": {"p50": round(firsts[len(firsts) // 2] * 1e3, 1), "max": round(firsts[-1] * 1e3, 1)},
        "step_profile": engine.profile.summary(),
    }


def run(engine: Engine, requests: int, input_len: int, output_len: int, vocab_size: int) -> list[dict[str, Any]]:
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))  # what a server's own warm-up request does
    bursts = []
    for seed, name in enumerate(("first", "second", "third"), start=1):
        prompts = throughput.make_prompts(requests, input_len, vocab_size, seed)
        bursts.append({"burst": name, **run_burst(engine, prompts, output_len, name)})
    return bursts


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(throughput.SHAPES))
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--show-steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    settings = argparse.Namespace(
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=2048,
        gpu_memory_utilization=0.9,
        kv_cache_dtype="auto",
    )
    _, model, model_dir = throughput.build_models(args.shape, settings.max_model_len)
    config = throughput.engine_config(model_dir, settings, cuda_graph_max_tokens=args.max_num_batched_tokens)
    engine = Engine(config, model=model)
    vocab_size = int(throughput.SHAPES[args.shape]["vocab_size"])
    bursts = run(engine, args.requests, args.input_len, args.output_len, vocab_size)
    print("| burst | seconds | out tok/s | steps | first token p50 / max ms | host ms/step (prepare, forward) |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for b in bursts:
        kinds = b["step_profile"].values()
        host = " ".join(
            f"{k['host_total_ms']} ({k['host_ms'].get('prepare', 0)}, {k['host_ms'].get('forward', 0)})" for k in kinds
        )
        first = b["first_token_ms"]
        print(
            f"| {b['burst']} | {b['seconds']} | {b['output_tokens_per_s']:,.0f} | {b['steps']} | "
            f"{first['p50']} / {first['max']} | {host} |"
        )
    for b in bursts:
        print(f"{b['burst']} steps ms: {b['steps_ms'][: args.show_steps]}")
    if args.json:
        settings_used = {**vars(args), "json": str(args.json)}
        args.json.write_text(json.dumps({"shape": args.shape, "args": settings_used, "bursts": bursts}))
    return bursts


if __name__ == "__main__":
    main()
