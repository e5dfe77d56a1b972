"""Mixed/prefill-step CUDA graphs on and off (issue 23): single-stream TTFT, offline throughput, same tokens.

For each random-weight shape (bench/throughput.py's SHAPES), two engines on the same model: decode graphs
only (`cuda_graph_max_tokens=0`, the engine before mixed graphs) and mixed graphs up to 2,048 tokens.
  single     prompts one at a time (512 tokens, 32 out): time to first token and inter-token latency
  throughput 256 x 512 x 256 (ignore_eos, greedy), 2,048-token steps, against the weight+KV floor
  tokens    greedy tokens of both engines on a few prompts of mixed lengths must be equal

    python3 -m bench.step_graphs --models smollm2-135m,llama-3.1-8b --json out.json   # CUDA only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench import throughput
from bench.serve.metrics import distribution_ms
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams


def single_stream(engine: Engine, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    ttfts: list[float] = []
    itls: list[float] = []
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        torch.cuda.synchronize()
        start = last = time.perf_counter()
        engine.add_request(f"single-{i}", prompt, params)
        seen = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids:
                    now = time.perf_counter()
                    (ttfts if seen == 0 else itls).append(now - (start if seen == 0 else last))
                    seen, last = seen + len(out.new_token_ids), now
    return {"ttft_ms": distribution_ms(ttfts), "itl_ms": distribution_ms(itls)}


def run_engine(
    model: Any, model_dir: Path, args: argparse.Namespace, graph_tokens: int, hw: dict[str, float]
) -> dict[str, Any]:
    config = throughput.engine_config(model_dir, args, cuda_graph_max_tokens=graph_tokens, profile_steps=False)
    start = time.perf_counter()
    engine = Engine(config, model=model)
    row: dict[str, Any] = {"graph_tokens": graph_tokens, "startup_s": round(time.perf_counter() - start, 1)}
    vocab = model.spec.vocab_size
    base = throughput.make_prompts(1, 512, vocab, seed=7)[0]
    check = [base[:n] for n in (5, 77, 300, 512)]
    row["tokens"] = [
        r.token_ids for r in engine.generate(check, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    ]
    engine.kv_cache.reset_prefix_cache()
    row["single"] = single_stream(engine, throughput.make_prompts(16, 512, vocab, seed=11), 32)
    engine.kv_cache.reset_prefix_cache()
    prompts = throughput.make_prompts(args.num_requests, args.prompt_len, vocab, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    row["output_tok_s"] = round(len(prompts) * args.output_len / seconds, 1)
    row["of_floor"] = round(throughput.floor_seconds(model, prompts, args.output_len, hw)["total_s"] / seconds, 3)
    del engine
    throughput.free_memory()
    print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    hw = throughput.measure_hardware()
    results: list[dict[str, Any]] = []
    for name in args.models.split(","):
        _, model, model_dir = throughput.build_models(name, args.max_model_len)
        rows = [run_engine(model, model_dir, args, tokens, hw) for tokens in (0, args.max_num_batched_tokens)]
        same = rows[0].pop("tokens") == rows[1].pop("tokens")
        results.append({"model": name, "device": torch.cuda.get_device_name(), "same_tokens": same, "rows": rows})
        del model
        throughput.free_memory()
    print("| model | mixed graphs | TTFT p50 ms (512 tok) | ITL p50 ms | out tok/s 256x512x256 | of floor | start s |")
    print("|---|---|---|---|---|---|---|")
    for result in results:
        for row in result["rows"]:
            print(
                f"| {result['model']} | {'up to ' + str(row['graph_tokens']) if row['graph_tokens'] else 'off'} "
                f"| {row['single']['ttft_ms']['p50']} | {row['single']['itl_ms']['p50']} | {row['output_tok_s']} "
                f"| {row['of_floor']} | {row['startup_s']} |"
            )
        print(f"same greedy tokens with and without ({result['model']}): {result['same_tokens']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
