"""Offline throughput of the engine (`Engine.generate`): prints a table, writes JSON to bench/results/.

Scenarios, each on a fresh engine sharing one loaded model, fixed output lengths (ignore_eos):
  plain          random prompts, the default KV cache
  shared-prefix  every prompt starts with the same long "system prompt": prefix-cache hits
  small-cache    a KV cache holding ~1/4 of the batch's tokens: preemptions and recompute

    python -m bench.offline                                  # SmolLM2 weights, CPU
    python -m bench.offline --random-weights --device cuda --num-requests 256 --prompt-len 512 \\
        --output-len 256 --compare-hf                        # vs HF generate_batch, same prompts
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from pagedserve.shared.model_source import resolve_model_dir

RESULTS_DIR = Path(__file__).parent / "results"


def make_prompts(args: argparse.Namespace, vocab_size: int, shared_prefix_len: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(100, vocab_size) for _ in range(shared_prefix_len)]
    prompts = []
    for _ in range(args.num_requests):
        length = rng.randint(max(1, args.prompt_len // 2), args.prompt_len)
        prompts.append(prefix + [rng.randrange(100, vocab_size) for _ in range(length)])
    return prompts


def run_scenario(name: str, model: Any, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    shared = args.shared_prefix_len if name == "shared-prefix" else 0
    prompts = make_prompts(args, model.spec.vocab_size, shared)
    num_kv_blocks = args.num_kv_blocks
    if name == "small-cache":
        needed = sum(-(-(len(p) + args.output_len) // args.block_size) for p in prompts)
        longest = max(len(p) for p in prompts) + args.output_len
        num_kv_blocks = max(needed // 4, -(-longest // args.block_size))
    config = Config.of(
        model=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
    )
    engine = Engine(config, model=model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True)
    engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2))  # warm-up
    before = engine.stats()
    _sync(args.device)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    num_output = sum(len(r.token_ids) for r in results)
    assert num_output == args.output_len * len(prompts)
    queried = after.num_prefix_cache_query_tokens - before.num_prefix_cache_query_tokens
    hits = after.num_prefix_cache_hit_tokens - before.num_prefix_cache_hit_tokens
    return {
        "scenario": name,
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": num_output,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "output_tokens_per_s": round(num_output / elapsed, 2),
        "total_tokens_per_s": round((after.num_computed_tokens - before.num_computed_tokens) / elapsed, 2),
        "prefix_cache_hit_rate": round(hits / queried, 4) if queried else 0.0,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "steps": after.num_steps - before.num_steps,
        "kv_blocks": after.num_total_blocks,
        "prompts": prompts if name == "plain" else None,  # for the HF comparison, dropped from JSON
    }


def run_hf_generate_batch(model_dir: Path, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """HF transformers' own continuous batching on the same weights and prompts."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    config = GenerationConfig(
        max_new_tokens=args.output_len,
        min_new_tokens=args.output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    _sync(args.device)
    start = time.perf_counter()
    outputs = hf.generate_batch(inputs=prompts, generation_config=config, warmup=args.device != "cpu")
    _sync(args.device)
    elapsed = time.perf_counter() - start
    num_output = sum(len(o.generated_tokens) for o in outputs.values())
    return {
        "scenario": "hf-generate_batch",
        "requests": len(prompts),
        "output_tokens": num_output,
        "seconds": round(elapsed, 3),
        "output_tokens_per_s": round(num_output / elapsed, 2),
    }


def random_weights_dir(model_dir: Path) -> Path:
    """The same architecture with random weights (vLLM's "dummy" load format), saved once per run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    out = Path(tempfile.mkdtemp(prefix="pagedserve-random-"))
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("generation_config.json",):
        if (model_dir / name).exists():
            (out / name).write_text((model_dir / name).read_text())
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = [
        "scenario",
        "requests",
        "prompt_tokens",
        "output_tokens",
        "seconds",
        "requests_per_s",
        "output_tokens_per_s",
        "total_tokens_per_s",
        "prefix_cache_hit_rate",
        "preemptions",
        "steps",
    ]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-|-".join("-" * widths[c] for c in columns))
    for row in rows:
        print(" | ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model name or directory (default: SmolLM2-135M)")
    parser.add_argument("--random-weights", action="store_true", help="same shapes, random weights")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64, help="prompts are uniform in [len/2, len]")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--shared-prefix-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--scenarios", default="plain,shared-prefix,small-cache")
    parser.add_argument("--compare-hf", action="store_true", help="also time HF generate_batch on 'plain'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/...)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    model_dir = resolve_model_dir(args.model)
    if args.random_weights:
        model_dir = random_weights_dir(model_dir)
    model = load_model(model_dir, args.dtype, args.device, show_progress=False)
    rows = [run_scenario(name, model, args, model_dir) for name in args.scenarios.split(",")]
    plain = next((r for r in rows if r["scenario"] == "plain"), None)
    if args.compare_hf and plain is not None:
        hf = run_hf_generate_batch(model_dir, plain["prompts"], args)
        hf["speedup_vs_hf"] = round(plain["output_tokens_per_s"] / hf["output_tokens_per_s"], 2)
        rows.append(hf)
    for row in rows:
        row.pop("prompts", None)
    print_table(rows)
    environment = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "model": str(args.model or "SmolLM2"),
        "random_weights": args.random_weights,
        "dtype": str(model.spec.dtype),
        "load_average": [round(x, 2) for x in os.getloadavg()],  # a shared CPU box skews timings
    }
    out = args.out or RESULTS_DIR / f"offline_{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"environment": environment, "args": {k: str(v) for k, v in vars(args).items()}, "results": rows}, indent=2
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
