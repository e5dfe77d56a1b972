"""Offline throughput on random-weight models of real shapes vs HF `generate_batch` and the hardware floor.

For each shape (configs below), in one process on one GPU: HF transformers builds the model with
random bf16 weights; our loader adopts the same tensors in memory (no disk round trip); then
  correctness  greedy tokens of our engine vs HF on the same weights: bf16 (first divergence, and the
               sampled tokens' logprob error against HF fp32 beside HF bf16's own), fp32 (identical)
  hf           `generate_batch` (HF's continuous batching) on the first --hf-requests prompts
  ours         `Engine.generate` on every prompt, with a profile of the step phases
  floor        performance.md: weights + live KV bytes per decode step over the measured copy rate,
               plus 2 * params * prompt tokens over the measured bf16 matmul rate
and on the Llama-3.2-1B shape 1,024 concurrent sequences (no OOM, no preemption expected).

    python -m bench.throughput                  # default workload: 256 x 512 prompt x 256 output tokens
    python -m bench.throughput --quick          # a small smoke run of every path
    python -m bench.throughput --models llama-3.1-8b --hf-requests 256
Writes throughput_<device>[_quick].json and .md under --out-dir (default bench/results).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={**LLAMA3_ROPE, "factor": 32.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={**LLAMA3_ROPE, "factor": 8.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}
HF_REFERENCE = {"smollm2-135m": 1126.0, "llama-3.2-1b": 1291.0, "llama-3.1-8b": 613.0}  # performance.md, H200
HF_REQUESTS = {"smollm2-135m": 256, "llama-3.2-1b": 256, "llama-3.1-8b": 128}  # 8B: HF alone takes ~2 min
TARGETS = {"smollm2-135m": {"vs_hf": 25.0}, "llama-3.1-8b": {"vs_hf": 15.0, "floor_fraction": 0.70}}
DEVICE = "cuda"  # a CPU smoke test of the script's logic swaps this (and torch.cuda) out
CUDA = torch.device(DEVICE)


def now() -> float:
    """A wall-clock reading once the GPU is idle."""
    torch.cuda.synchronize()
    return time.perf_counter()


def measure_hardware() -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate: medians of event-timed repeats."""

    def median_ms(fn: Any, repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    src = torch.randn(1 << 30, device=CUDA, dtype=torch.bfloat16)  # 2 GiB: far beyond L2
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src), 20)
    a, b = (torch.randn(8192, 8192, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = median_ms(lambda: a @ b, 20)
    return {
        "copy_bytes_per_s": 2 * 2 * (1 << 30) / (copy_ms / 1e3),
        "bf16_flops_per_s": 2 * 8192**3 / (matmul_ms / 1e3),
    }


def build_models(name: str, max_model_len: int, quantization: str | None = None) -> tuple[Any, Any, Path]:
    """HF's random bf16 model on the GPU, and ours on the same tensors."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[name], architectures=["LlamaForCausalLM"])
    model_dir = Path(tempfile.mkdtemp(prefix=f"pagedserve-{name}-"))
    config.save_pretrained(model_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(model_dir)
    torch.manual_seed(0)
    with CUDA:  # initialised on the GPU, in bf16: seconds even for 8B
        hf = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval().requires_grad_(False)
    ours = load_model(
        model_dir,
        "bf16",
        CUDA,
        max_model_len=max_model_len,
        show_progress=False,
        tensors=hf.state_dict().items(),
        quantization=quantization,
    )
    return hf, ours, model_dir


def make_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(num)]


def hf_greedy(hf: Any, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=CUDA)
    out = hf.generate(
        ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def hf_token_logprobs(hf: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:  # [len(tokens)]
    ids = torch.tensor([prompt + tokens], device=CUDA)
    with torch.inference_mode():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens, device=CUDA)[:, None])[:, 0]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def check_greedy(
    hf: Any, model: Any, model_dir: Path, dtype: str, num_tokens: int, kv_cache_dtype: str = "auto"
) -> list[dict[str, Any]]:
    """Our engine (CUDA graphs, overlap) vs HF generate, greedy, on prompts of mixed lengths."""
    base = make_prompts(1, 512, model.spec.vocab_size, seed=7)[0]
    prompts = [base[:n] for n in (5, 77, 300, 512)]
    config = Config.of(
        model=str(model_dir),
        dtype=dtype,
        device=DEVICE,
        num_kv_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        cuda_graph_max_batch=8,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = Engine(config, model=model)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    results = engine.generate(prompts, params)
    del engine
    return [
        {
            "prompt": prompt,
            "tokens": r.token_ids,
            "logprobs": [lp.logprob for lp in r.logprobs or []],
            "first_divergence": first_divergence(r.token_ids, hf_greedy(hf, prompt, num_tokens)),
        }
        for prompt, r in zip(prompts, results)
    ]


def correctness(
    hf: Any, ours: Any, model_dir: Path, num_tokens: int, with_fp32: bool, kv_cache_dtype: str = "auto"
) -> dict[str, Any]:
    """bf16: where greedy tokens first differ from HF bf16, and the error of our sampled tokens'
    logprobs against HF fp32 on the same tokens (HF bf16's own error beside it). fp32: identical.
    The bf16 check runs with the variant's KV cache dtype (an fp8 cache's error shows here)."""
    rows = check_greedy(hf, ours, model_dir, "bfloat16", num_tokens, kv_cache_dtype)
    hf32 = copy.deepcopy(hf).float()
    ours_err, hf_err = [], []
    for row in rows:
        ref = hf_token_logprobs(hf32, row["prompt"], row["tokens"])
        ours_err.append((torch.tensor(row["logprobs"], device=CUDA) - ref).abs())
        hf_err.append((hf_token_logprobs(hf, row["prompt"], row["tokens"]) - ref).abs())
    ours_all, hf_all = torch.cat(ours_err), torch.cat(hf_err)
    out: dict[str, Any] = {
        "bf16": {
            "prompt_lens": [len(r["prompt"]) for r in rows],
            "num_tokens": num_tokens,
            "first_divergence_vs_hf_bf16": [r["first_divergence"] for r in rows],
            "logprob_abs_err_vs_hf_fp32": {
                "ours_max": float(ours_all.max()),
                "ours_mean": float(ours_all.mean()),
                "hf_bf16_max": float(hf_all.max()),
                "hf_bf16_mean": float(hf_all.mean()),
            },
        }
    }
    if with_fp32:
        ours32 = load_model(
            model_dir, "fp32", CUDA, max_model_len=1024, show_progress=False, tensors=hf32.state_dict().items()
        )
        rows32 = check_greedy(hf32, ours32, model_dir, "float32", num_tokens)
        divergence = [r["first_divergence"] for r in rows32]
        out["fp32"] = {"first_divergence_vs_hf_fp32": divergence, "identical": all(d is None for d in divergence)}
        del ours32
    del hf32
    free_memory()
    return out


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def run_hf(hf: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    start = now()
    outputs = hf.generate_batch(inputs=prompts, generation_config=config, warmup=True)
    seconds = now() - start
    num_output = sum(len(o.generated_tokens) for o in outputs.values())
    free_memory()
    return {
        "requests": len(prompts),
        "output_tokens": num_output,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(num_output / seconds, 1),
    }


def engine_config(model_dir: Path, args: argparse.Namespace, **changes: Any) -> Config:
    settings = dict(
        model=str(model_dir),
        dtype="bfloat16",
        device=DEVICE,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        profile_steps=True,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
    )
    return Config.of(**{**settings, **changes})


def run_ours(model: Any, model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    start = now()
    engine = Engine(engine_config(model_dir, args), model=model)
    startup = now() - start
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = now()
    results = engine.generate(prompts, params)
    seconds = now() - start
    num_output = sum(len(r.token_ids) for r in results)
    assert num_output == len(prompts) * args.output_len
    stats = engine.stats()
    out = {
        "requests": len(prompts),
        "output_tokens": num_output,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(num_output / seconds, 1),
        "startup_seconds": round(startup, 2),
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
        "kv_blocks": stats.num_total_blocks,
        "profile_per_step": engine.profile.summary(),
    }
    del engine, results
    free_memory()
    return out


def floor_seconds(
    model: Any, prompts: list[list[int]], output_len: int, hw: dict[str, float], kv_cache_dtype: str = "auto"
) -> dict[str, float]:
    """performance.md's limit: every decode step reads all weights and every live KV entry (all
    requests in one batch); prefill is 2 * params FLOPs per prompt token."""
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = model.spec.kv_bytes_per_token(torch.float8_e4m3fn if kv_cache_dtype == "fp8" else None)
    live_kv_tokens = sum(len(p) * output_len + output_len * (output_len - 1) // 2 for p in prompts)
    decode = (output_len * weight_bytes + live_kv_tokens * kv_bytes) / hw["copy_bytes_per_s"]
    prefill = 2 * params * sum(len(p) for p in prompts) / hw["bf16_flops_per_s"]
    return {
        "prefill_s": round(prefill, 3),
        "decode_s": round(decode, 3),
        "total_s": round(prefill + decode, 3),
        "params": params,
        "weight_bytes": weight_bytes,
    }


def run_concurrency(model: Any, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """1,024 sequences at once (sampled with top_p, so the sampler's widest path runs at that size)."""
    # Outputs outlast admission (~32 steps of 16k prompt tokens), so all 1,024 run at once.
    num, prompt_len, output_len = 1024, (32 if args.quick else 512), (4 if args.quick else 64)
    config = engine_config(model_dir, args, max_num_seqs=num, max_num_batched_tokens=16384)
    engine = Engine(config, model=model)
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=output_len, ignore_eos=True, seed=None)
    for i, prompt in enumerate(make_prompts(num, prompt_len, model.spec.vocab_size, seed=3)):
        engine.add_request(f"c{i}", prompt, params)
    max_running, num_tokens = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
        max_running = max(max_running, engine.stats().num_running)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    out = {
        "requests": num,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "max_running": max_running,
        "output_tokens": num_tokens,
        "seconds": round(seconds, 2),
        "preemptions": stats.num_preemptions,
        "kv_blocks": stats.num_total_blocks,
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "profile_per_step": engine.profile.summary(),
    }
    assert num_tokens == num * output_len
    del engine
    free_memory()
    return out


VARIANTS = {"bf16": (None, "auto"), "fp8": ("fp8", "auto"), "fp8kv": (None, "fp8"), "fp8+fp8kv": ("fp8", "fp8")}


def bench_model(name: str, args: argparse.Namespace, hw: dict[str, float]) -> Iterator[dict[str, Any]]:
    """One row per variant (weights x KV cache dtype), all on the same random HF model and prompts."""
    print(f"== {name}", flush=True)
    start = now()
    hf, ours, model_dir = build_models(name, args.max_model_len)
    build_s = now() - start
    prompts = make_prompts(args.num_requests, args.prompt_len, ours.spec.vocab_size, seed=0)
    num_hf = args.hf_requests if args.hf_requests is not None else HF_REQUESTS[name]
    num_hf = min(num_hf, len(prompts))
    hf_row = run_hf(hf, prompts[:num_hf], args.output_len) if num_hf > 0 else None
    if hf_row is not None:
        print("hf", hf_row, flush=True)
    loaded: str | None = None  # the quantization `ours` was loaded with
    for variant in args.variants.split(","):
        quantization = VARIANTS[variant][0]
        if quantization != loaded:
            loaded = quantization
            del ours
            free_memory()
            ours = load_model(
                model_dir,
                "bf16",
                CUDA,
                max_model_len=args.max_model_len,
                show_progress=False,
                tensors=hf.state_dict().items(),
                quantization=quantization,
            )
        row = bench_variant(name, variant, hf, ours, model_dir, prompts, hf_row, args, hw)
        row["build_seconds"] = round(build_s, 1)
        yield row  # the caller saves each row as it comes: a later variant's failure or timeout loses only it
    del hf, ours
    free_memory()


def bench_variant(
    name: str,
    variant: str,
    hf: Any,
    ours: Any,
    model_dir: Path,
    prompts: list[list[int]],
    hf_row: dict[str, Any] | None,
    args: argparse.Namespace,
    hw: dict[str, float],
) -> dict[str, Any]:
    print(f"-- {name} {variant}", flush=True)
    quantization, kv_cache_dtype = VARIANTS[variant]
    args.kv_cache_dtype = kv_cache_dtype  # read by engine_config
    row: dict[str, Any] = {
        "model": name,
        "variant": variant,
        "quantization": quantization or "none",
        "kv_cache_dtype": kv_cache_dtype,
    }
    if not args.skip_correctness and variant in args.check_variants.split(","):
        row["correctness"] = correctness(
            hf,
            ours,
            model_dir,
            args.check_tokens,
            with_fp32=name != "llama-3.1-8b" and variant == "bf16",
            kv_cache_dtype=kv_cache_dtype,
        )
        print(json.dumps(row["correctness"]), flush=True)
    if hf_row is not None:
        row["hf"] = hf_row
    row["ours"] = run_ours(ours, model_dir, prompts, args)
    print("ours", json.dumps(row["ours"]), flush=True)
    floor = floor_seconds(ours, prompts, args.output_len, hw, kv_cache_dtype)
    floor_tps = len(prompts) * args.output_len / floor["total_s"]
    ours_tps = row["ours"]["output_tokens_per_s"]
    row["floor"] = {**floor, "output_tokens_per_s": round(floor_tps, 1), "fraction": round(ours_tps / floor_tps, 3)}
    if "hf" in row:
        row["speedup_vs_hf"] = round(ours_tps / row["hf"]["output_tokens_per_s"], 2)
    row["speedup_vs_hf_reference"] = round(ours_tps / HF_REFERENCE[name], 2)
    targets = TARGETS.get(name, {}) if variant == "bf16" else {}
    row["targets"] = {
        key: {"target": goal, "measured": row.get("speedup_vs_hf") if key == "vs_hf" else row["floor"]["fraction"]}
        for key, goal in targets.items()
    }
    if name == "llama-3.2-1b" and not args.skip_concurrency and variant == "bf16":
        row["concurrency_1024"] = run_concurrency(ours, model_dir, args)
        print("concurrency", json.dumps(row["concurrency_1024"]), flush=True)
    return row


def _decode_step(row: dict[str, Any]) -> str:
    graph = row["ours"]["profile_per_step"].get("graph")
    if not graph:
        return "-"
    return f"{graph['host_total_ms']:.2f} / {sum(graph['gpu_ms'].values()):.2f}"


def _logprob_error(row: dict[str, Any]) -> str:
    err = row.get("correctness", {}).get("bf16", {}).get("logprob_abs_err_vs_hf_fp32")
    if not err:
        return "-"
    ours = f"max {err['ours_max']:.3f} mean {err['ours_mean']:.3f}"
    return f"{ours} ({err['hf_bf16_max']:.3f} / {err['hf_bf16_mean']:.3f})"


def markdown(report: dict[str, Any]) -> str:
    env, wl = report["environment"], report["workload"]
    lines = [
        f"# Offline throughput: {env['device']}, {env['date']}",
        "",
        f"`{env['command']}`",
        "",
        f"Workload: {wl['num_requests']} requests x {wl['prompt_len']} random prompt tokens x "
        f"{wl['output_len']} output tokens (ignore_eos, greedy), random bf16 weights. Measured copy rate "
        f"{report['hardware']['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
        f"{report['hardware']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s.",
        "",
        "| model | ours out tok/s | HF generate_batch tok/s (requests) | ours / HF | ours / HF ref. "
        "| floor tok/s | of floor | decode step host / GPU ms | logprob err vs HF fp32 (HF bf16) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["models"]:
        hf = row.get("hf", {})
        lines.append(
            f"| {row['model']} {row.get('variant', '')} | {row['ours']['output_tokens_per_s']:,.0f} | "
            f"{hf.get('output_tokens_per_s', float('nan')):,.0f} ({hf.get('requests', 0)}) | "
            f"{row.get('speedup_vs_hf', float('nan'))}x | {row['speedup_vs_hf_reference']}x | "
            f"{row['floor']['output_tokens_per_s']:,.0f} | {row['floor']['fraction']:.0%} | "
            f"{_decode_step(row)} | {_logprob_error(row)} |"
        )
    lines += [
        "",
        "HF ref.: performance.md's HF generate_batch on the full workload, H200 (1,126 / 1,291 / 613 tok/s).",
        "Step profiles (mean ms per step), correctness and the 1,024-sequence run are in the JSON.",
    ]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--quick", action="store_true", help="64 x 128 x 32 tokens, HF on 16 requests")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--hf-requests", type=int, default=None, help=f"HF on the first N prompts (default {HF_REQUESTS})"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per correctness prompt")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-concurrency", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--variants",
        default="bf16",
        help=f"comma-separated, of {', '.join(VARIANTS)} (fp8 = FP8 weights quantised at load, fp8kv = e4m3 KV cache)",
    )
    parser.add_argument(
        "--check-variants",
        default="bf16,fp8,fp8kv,fp8+fp8kv",
        help="variants that get the correctness check (unless --skip-correctness)",
    )
    parser.add_argument("--tag", default="", help="appended to the output file names (e.g. _fp8)")
    args = parser.parse_args()
    args.kv_cache_dtype = "auto"
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 64, 128, 32
        args.hf_requests = 16 if args.hf_requests is None else args.hf_requests
    return args


def main() -> None:
    args = parse_args()
    import transformers
    import triton

    hw = measure_hardware()
    print(
        f"copy {hw['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul {hw['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    device = torch.cuda.get_device_name()
    report: dict[str, Any] = {
        "environment": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": device,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
            "command": "python -m bench.throughput " + " ".join(sys.argv[1:]),
        },
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "variants": args.variants,
        },
        "hardware": hw,
        "models": [],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "throughput_" + device.split()[-1].lower() + ("_quick" if args.quick else "") + args.tag
    for name in args.models.split(","):
        for row in bench_model(name, args, hw):
            report["models"].append(row)
            (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2))  # partial results survive
            (args.out_dir / f"{stem}.md").write_text(markdown(report))
    table = markdown(report)
    (args.out_dir / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
