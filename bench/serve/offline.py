"""`--offline`: the engine alone (`Engine`, in this process) on the served run's prompts, and the
pipeline tax: what the services around it cost in throughput and in time to first token.

  throughput   `Engine.generate` on every prompt of the main run (greedy, fixed output lengths), as
               bench/throughput.py times it, with its engine settings
  single       prompts one at a time: time from add_request to the step that brings the first
               token, and the mean step time after it (the offline TTFT and ITL)

The model: `--offline-model-dir` (weights on disk, e.g. the directory the server loads), or
`--offline-shape` (bench/throughput.py's random-weight shapes, built in memory).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

from bench import throughput
from bench.serve.datasets import BenchRequest
from bench.serve.metrics import distribution_ms


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_engine(args: argparse.Namespace) -> Any:
    from pagedserve.services.engine.engine import Engine
    from pagedserve.shared.model_source import resolve_model_dir

    settings = argparse.Namespace(
        max_num_seqs=args.offline_max_num_seqs,
        max_num_batched_tokens=args.offline_max_num_batched_tokens,
        max_model_len=args.offline_max_model_len,
        gpu_memory_utilization=args.offline_gpu_memory_utilization,
        kv_cache_dtype="auto",
    )  # the served engine's default
    model = None
    if args.offline_shape:
        if not args.offline_device.startswith("cuda"):
            raise SystemExit("--offline-shape builds bf16 weights on the GPU; use --offline-model-dir on CPU")
        hf, model, model_dir = throughput.build_models(args.offline_shape, args.offline_max_model_len)
        del hf  # ours holds the same tensors
    else:
        model_dir = resolve_model_dir(args.offline_model_dir or args.tokenizer or args.model)
    max_tokens = args.offline_cuda_graph_max_tokens
    graph_tokens = {} if max_tokens is None else {"cuda_graph_max_tokens": max_tokens}
    config = throughput.engine_config(
        model_dir,
        settings,
        device=args.offline_device,
        dtype=args.offline_dtype,
        profile_steps=args.offline_profile_steps,
        **graph_tokens,
    )
    return Engine(config, model=model)


def run_throughput(engine: Any, requests: list[BenchRequest], device: str) -> dict[str, Any]:
    from pagedserve.services.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    _sync(device)
    start = time.perf_counter()
    results = engine.generate([r.prompt_ids for r in requests], params)
    _sync(device)
    seconds = time.perf_counter() - start
    output_tokens = sum(len(c.token_ids) for res in results for c in res.choices)
    input_tokens = sum(r.prompt_len for r in requests)
    return {
        "requests": len(requests),
        "seconds": round(seconds, 3),
        "output_tokens": output_tokens,
        "output_throughput": round(output_tokens / seconds, 1),
        "total_token_throughput": round((input_tokens + output_tokens) / seconds, 1),
    }


def run_single(engine: Any, requests: list[BenchRequest], device: str) -> dict[str, Any]:
    """One request at a time: its time to first token and the gaps between its tokens' steps."""
    from pagedserve.services.engine.sampling_params import SamplingParams

    ttfts, itls = [], []
    for i, request in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        _sync(device)
        start = last = time.perf_counter()
        engine.add_request(f"single-{i}", request.prompt_ids, params)
        seen = 0
        while engine.has_unfinished():
            for out in engine.step():
                if not out.new_token_ids:
                    continue
                now = time.perf_counter()
                if seen == 0:
                    ttfts.append(now - start)
                else:
                    itls.append((now - last) / len(out.new_token_ids))
                seen += len(out.new_token_ids)
                last = now
    return {"requests": len(requests), "ttft_ms": distribution_ms(ttfts), "itl_ms": distribution_ms(itls)}


def run_offline(args: argparse.Namespace, main: list[BenchRequest], single: list[BenchRequest]) -> dict[str, Any]:
    """Both offline runs; the engine and its memory are gone when this returns."""
    device = args.offline_device
    if args.offline_cpu_threads:
        torch.set_num_threads(args.offline_cpu_threads)
    start = time.perf_counter()
    engine = build_engine(args)
    startup = time.perf_counter() - start
    from pagedserve.services.engine.sampling_params import SamplingParams

    engine.generate([main[0].prompt_ids[:8]], SamplingParams(max_tokens=4))  # warm-up (CUDA: also when built)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "startup_s": round(startup, 1),
        "model": args.offline_shape or args.offline_model_dir or args.tokenizer or args.model,
    }
    engine.profile.reset()
    out["throughput"] = run_throughput(engine, main, device)
    print(f"offline: {out['throughput']}", flush=True)
    if engine.profile.enabled:  # the served engine logs the same table per busy period (PAGEDSERVE_PROFILE_STEPS=1)
        out["step_profile"] = engine.profile.summary()
        print(f"offline step profile: {json.dumps(out['step_profile'])}", flush=True)
    engine.kv_cache.reset_prefix_cache()  # the single-stream prompts must not hit the cache either
    if single:
        out["single"] = run_single(engine, single, device)
        print(f"offline single stream: {out['single']}", flush=True)
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def pipeline_tax(
    offline: dict[str, Any], served: dict[str, Any], served_single: dict[str, Any] | None
) -> dict[str, Any]:
    """Served vs offline: throughput ratio (1.0 = no tax), and TTFT / ITL differences at one stream."""
    tax: dict[str, Any] = {
        "served_output_throughput": served["output_throughput"],
        "offline_output_throughput": offline["throughput"]["output_throughput"],
        "served_over_offline": round(served["output_throughput"] / offline["throughput"]["output_throughput"], 3),
    }
    if served_single is not None and "single" in offline:
        for key in ("ttft_ms", "itl_ms"):
            s, o = served_single[key]["p50"], offline["single"][key]["p50"]
            tax[f"single_{key}_p50"] = {"served": s, "offline": o, "difference": round(s - o, 3)}
    return tax
