"""Multi-LoRA serving cost: mixed-adapter batches and batch-1 latency against the base model, random weights.

On a random-weight model of a real shape (default the Llama-3.1-8B shape, bf16), with random rank-16 PEFT
adapters on q/k/v/o/gate/up/down written to disk in PEFT's format:
  base        an engine without --enable-lora: --concurrency requests at once, then one request alone
  lora-idle   an engine with --enable-lora and the adapters loaded, serving base requests (the price of
              having LoRA on: such steps run the base graphs, no LoRA kernel, so it should equal base)
  lora-mixed  the same engine, each request naming one of --num-adapters adapters (round robin), so every
              step mixes them all; and one adapter request alone (batch-1 overhead)
Throughput is output tokens per second over the whole batch; batch 1 reports the inter-token latency.
Goals (issue 26, on an H100): lora-mixed >= 75% of base throughput at 256 concurrent, batch-1 overhead <= 15%.
On CUDA, --profile-steps decode steps of the one-request run go through torch.profiler: the GPU kernels per step
(graph replays included), the LoRA kernels and memsets among them, and their GPU time, to explain what the
batch-1 overhead is made of (a base-only step should count what the base engine's does).

    python -m bench.lora                  # the 8B shape on CUDA: 8 adapters, 256 concurrent, 512 + 128 tokens
    python -m bench.lora --quick          # a tiny shape on the CPU: checks every path runs
Writes lora_<device>[_quick].json under --out-dir (default bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_dir_for(shape: dict[str, Any]) -> Path:
    """A checkpoint folder with only config.json: the engine fills random weights (--load-format random)."""
    from transformers import GenerationConfig, LlamaConfig

    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    path = Path(tempfile.mkdtemp(prefix="pagedserve-lora-bench-"))
    config.save_pretrained(path)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(path)
    return path


def write_adapter(out: Path, shape: dict[str, Any], rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a Llama shape."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    dims = {  # projection -> (in, out)
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for proj, (n_in, n_out) in dims.items():
            module = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).bfloat16()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run_batch(engine: Engine, prompts: list[list[int]], names: list[str | None], max_tokens: int) -> dict[str, Any]:
    """All requests at once; output tokens per second, and (for one request) the inter-token latency."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(f"r{i}-{start}", prompt, params, lora_name=name)
    num_tokens, first_token_at = 0, None
    while engine.has_unfinished():
        outputs = engine.step()
        got = sum(len(o.new_token_ids) for o in outputs)
        if got and first_token_at is None:
            first_token_at = time.perf_counter()
        num_tokens += got
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    decode_s = seconds - ((first_token_at or start) - start)
    per_request = max_tokens - 1 if len(prompts) == 1 else None
    return {
        "requests": len(prompts),
        "output_tokens": num_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(num_tokens / seconds, 2),
        "itl_ms": round(decode_s * 1e3 / per_request, 4) if per_request else None,
    }


def profile_decode(engine: Engine, prompt: list[int], name: str | None, num_steps: int) -> dict[str, Any]:
    """GPU kernels per decode step of one request (CUDA): every kernel, the LoRA ones, memsets and fills, and
    their GPU time (µs per step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    num_warm = 4
    params = SamplingParams(temperature=0.0, max_tokens=num_warm + num_steps + 4, ignore_eos=True)
    engine.add_request(f"profile-{name}-{time.perf_counter()}", prompt, params, lora_name=name)
    num_tokens = 0
    while engine.has_unfinished() and num_tokens < num_warm:  # the prompt's step, then a few decode steps
        num_tokens += sum(len(o.new_token_ids) for o in engine.step())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    counts = {"kernels": 0, "lora_kernels": 0, "fills": 0}
    times = {"kernels": 0.0, "lora_kernels": 0.0, "fills": 0.0}
    by_kernel: dict[str, float] = {}  # LoRA GPU µs per step, shrink and expand apart
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        kind = (
            "lora_kernels"
            if "_shrink_kernel" in event.name or "_expand_kernel" in event.name
            else "fills"
            if "memset" in event.name.lower() or "FillFunctor" in event.name
            else None
        )
        elapsed = event.time_range.elapsed_us()
        if kind == "lora_kernels":
            name = "shrink" if "_shrink_kernel" in event.name else "expand"
            by_kernel[name] = by_kernel.get(name, 0.0) + elapsed
        counts["kernels"] += 1
        times["kernels"] += elapsed
        if kind is not None:
            counts[kind] += 1
            times[kind] += elapsed
    return {
        "steps": num_steps,
        **{f"{key}_per_step": round(value / num_steps, 1) for key, value in counts.items()},
        **{f"{key}_gpu_us_per_step": round(value / num_steps, 1) for key, value in times.items()},
        "lora_gpu_us_per_step_by_kernel": {key: round(value / num_steps, 1) for key, value in by_kernel.items()},
    }


def measure(
    config: Config, prompts: list[list[int]], scenarios: dict[str, list[str | None]], args: argparse.Namespace
) -> dict[str, Any]:
    """Each scenario (its adapter per request) on one engine: the whole batch, then its first request alone."""
    engine = Engine(config)
    results = {}
    for scenario, names in scenarios.items():
        run_batch(engine, prompts[: args.warmup], names[: args.warmup], 4)  # compiles the LoRA kernels' shapes
        results[scenario] = {
            "batch": run_batch(engine, prompts, names, args.output_len),
            "single": run_batch(engine, prompts[:1], names[:1], args.output_len),
        }
        if args.profile_steps and engine.device.type == "cuda":
            results[scenario]["profile"] = profile_decode(engine, prompts[0], names[0], args.profile_steps)
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny shape on the CPU, a few requests")
    parser.add_argument("--shape", default="llama-3.1-8b", help="a shape of bench/throughput.py")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=16, help="requests of the warm-up batch")
    parser.add_argument(
        "--profile-steps", type=int, default=16, help="CUDA: decode steps of one request to profile (0: none)"
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.prompt_len, args.output_len, args.num_adapters = 12, 24, 8, 4
        args.warmup = 4
        shape, device, dtype = TINY_SHAPE, "cpu", "float32"
    else:
        from bench.throughput import SHAPES

        shape, device, dtype = SHAPES[args.shape], "cuda", "bfloat16"
    model_dir = model_dir_for(shape)
    adapter_root = Path(tempfile.mkdtemp(prefix="pagedserve-lora-adapters-"))
    adapters = {
        f"lora{i}": write_adapter(adapter_root / f"lora{i}", shape, args.rank, seed=i) for i in range(args.num_adapters)
    }
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, shape["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(args.concurrency)
    ]
    mixed: list[str | None] = [f"lora{i % args.num_adapters}" for i in range(args.concurrency)]
    base_names: list[str | None] = [None] * args.concurrency
    common: dict[str, Any] = dict(
        model=str(model_dir),
        load_format="random",
        dtype=dtype,
        device=device,
        max_num_seqs=max(args.concurrency, 1),
        max_model_len=args.prompt_len + args.output_len + 16,
        enable_prefix_caching=False,  # every request computes its prompt: the same work in each scenario
    )
    lora = dict(
        enable_lora=True,
        lora_modules=[f"{name}={path}" for name, path in adapters.items()],
        max_loras=args.num_adapters,
        max_lora_rank=max(args.rank, 16),
    )
    try:
        rows = measure(Config.of(**common), prompts, {"base": base_names}, args)
        rows |= measure(Config.of(**common, **lora), prompts, {"lora-idle": base_names, "lora-mixed": mixed}, args)
    finally:  # the 8B shape's adapters take ~80 MB each
        shutil.rmtree(adapter_root, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)
    base, mixed_row = rows["base"], rows["lora-mixed"]
    summary = {
        "mixed_throughput_vs_base": round(mixed_row["batch"]["tokens_per_s"] / base["batch"]["tokens_per_s"], 4),
        "batch1_itl_overhead": (
            round(mixed_row["single"]["itl_ms"] / base["single"]["itl_ms"] - 1, 4) if base["single"]["itl_ms"] else None
        ),
    }
    print(f"{'scenario':<12} {'tok/s @' + str(args.concurrency):>14} {'batch-1 ITL ms':>15}")
    for name, row in rows.items():
        print(f"{name:<12} {row['batch']['tokens_per_s']:>14.1f} {row['single']['itl_ms'] or 0:>15.3f}")
    profiled = {name: row["profile"] for name, row in rows.items() if "profile" in row}
    if profiled:
        print(f"{'batch 1, per step':<18} {'kernels':>8} {'LoRA':>6} {'fills':>6} {'GPU us':>8} {'LoRA us':>8}")
    for name, prof in profiled.items():
        print(
            f"{name:<18} {prof['kernels_per_step']:>8.1f} {prof['lora_kernels_per_step']:>6.1f} "
            f"{prof['fills_per_step']:>6.1f} {prof['kernels_gpu_us_per_step']:>8.1f} "
            f"{prof['lora_kernels_gpu_us_per_step']:>8.1f}"
        )
    print(f"mixed / base throughput: {summary['mixed_throughput_vs_base']:.3f} (goal >= 0.75)")
    print(f"batch-1 ITL overhead: {summary['batch1_itl_overhead']} (goal <= 0.15)")
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report = {
        "device": device_name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.lora", *sys.argv[1:]]),
        "shape": "tiny" if args.quick else args.shape,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "summary": summary,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if device == "cpu" else device_name.split()[-1].lower().replace("/", "-")
    out = args.out_dir / f"lora_{tag}{'_quick' if args.quick else ''}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
