"""Tensor parallelism on random-weight models of real shapes: TP=2 vs TP=1, and a 70B shape on 2 GPUs.

Each phase runs in its own process (a fresh CUDA context and process group; rank 0 starts rank 1):
  8b-tp1 / 8b-tp2  Llama-3.1-8B shape, bf16, random weights from one seed (identical at both sizes:
                   every full tensor is generated from (seed, name) and sliced): greedy tokens and
                   their logprobs on 4 prompts, output tok/s on the throughput workload, and
                   single-stream inter-token latency (ITL: one request, 512 prompt tokens)
  8b-fp32          the same weights in fp32 on one GPU: the reference greedy tokens, and the fp32
                   logprobs of the tokens each bf16 run chose (teacher-forced): the logprob error
  70b-tp2          Llama-3.1-70B shape, bf16, random weights generated on each rank (it cannot fit
                   one GPU): output tok/s and its fraction of the two-GPU floor (performance.md:
                   every decode step reads all weights and live KV once, over both GPUs' bandwidth;
                   prefill at both GPUs' matmul rate)

    python -m bench.tensor_parallel                      # everything (~6-8 min on 2 H200s)
    python -m bench.tensor_parallel --phases 8b-tp1,8b-tp2,8b-fp32
    python -m bench.tensor_parallel --phases 70b-tp2
    python -m bench.tensor_parallel --device cpu --quick # a CPU smoke run of the logic (tiny shape, gloo)
    python -m bench.tensor_parallel --phases 8b-tp1,8b-tp2 --disable-custom-all-reduce   # TP all-reduces by NCCL
    python -m bench.tensor_parallel --phases 8b-tp2 --custom-all-reduce-max-bytes 8388608  # torch's symm-mem
    python -m bench.tensor_parallel --phases 8b-tp2 --fused-all-reduce-max-bytes 0  # o/down outputs by NCCL
Prints a table; writes tensor_parallel_<device>[_quick][_nccl_all_reduce].json and .md under --out-dir
(bench/results). Child processes inherit the environment (NCCL_* settings included; NVLink multicast is
off unless the environment says otherwise: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagedserve.services.engine.attention import AttentionMetadata
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.parallel import partial_sums
from pagedserve.services.engine.parallel.state import all_reduce_limits
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "factor": 8.0,
}
SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "70b": dict(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),  # the CPU smoke run
}
PHASES = ("8b-tp1", "8b-tp2", "8b-fp32", "70b-tp2")  # the default run; also 8b-tp4, 70b-tp4, ... (N GPUs)
ITL_TARGET = 0.6  # TP=2 single-stream ITL <= 0.6x TP=1's (the issue's target)


def write_model_dir(shape: str, max_position: int) -> Path:
    cfg = {
        **SHAPES[shape],
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": max_position,
        "rope_parameters": LLAMA3_ROPE,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    model_dir = Path(tempfile.mkdtemp(prefix=f"pagedserve-tp-{shape}-"))
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


def make_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(num)]


def correctness_prompts(vocab_size: int, quick: bool) -> list[list[int]]:
    base = make_prompts(1, 512, vocab_size, seed=7)[0]
    return [base[:n] for n in ((5, 40) if quick else (5, 77, 300, 512))]


def sync(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def engine_config(model_dir: Path, args: argparse.Namespace, tp: int, dtype: str = "bfloat16") -> Config:
    return Config.of(
        model=str(model_dir),
        dtype=dtype,
        device=args.device,
        load_format="random",
        seed=0,
        tensor_parallel_size=tp,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
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
        cuda_graph_max_batch=args.cuda_graph_max_batch,
        **({} if args.gemv_max_rows is None else {"gemv_max_rows": args.gemv_max_rows}),
        **({} if args.pdl is None else {"pdl": bool(args.pdl)}),
        **({} if args.fused_push is None else {"fused_all_reduce_push": bool(args.fused_push)}),
        num_kv_blocks=None if args.device == "cuda" else 256,
    )


def greedy_with_logprobs(engine: Engine, prompts: list[list[int]], num_tokens: int) -> list[dict[str, Any]]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    out = []
    for r in engine.generate(prompts, params):
        assert r.logprobs is not None
        out.append({"tokens": r.token_ids, "logprobs": [lp.logprob for lp in r.logprobs]})
    return out


def throughput(engine: Engine, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = sync(args.device)
    results = engine.generate(prompts, params)
    seconds = sync(args.device) - start
    num_output = sum(len(r.token_ids) for r in results)
    assert num_output == args.num_requests * args.output_len
    stats = engine.stats()
    return {
        "requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "output_tokens": num_output,
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(num_output / seconds, 1),
        "preemptions": stats.num_preemptions,
        "kv_blocks": stats.num_total_blocks,
    }


def single_stream_itl(engine: Engine, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """One request: the gaps between its successive tokens as `step()` hands them out."""
    prompt = make_prompts(1, args.prompt_len, vocab_size, seed=2)[0]
    engine.add_request("itl", prompt, SamplingParams(temperature=0.0, max_tokens=args.itl_tokens, ignore_eos=True))
    stamps: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            stamps += [time.perf_counter()] * len(out.new_token_ids)
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps[1:]))  # from the 2nd token: no prefill
    p50, p90 = gaps[len(gaps) // 2], gaps[int(len(gaps) * 0.9)]
    return {
        "tokens": len(stamps),
        "itl_ms_p50": round(1e3 * p50, 3),
        "itl_ms_p90": round(1e3 * p90, 3),
        "itl_ms_mean": round(1e3 * sum(gaps) / len(gaps), 3),
    }


@torch.inference_mode()
def teacher_forced_logprobs(engine: Engine, prompt: list[int], tokens: list[int]) -> list[float]:
    """Logprobs of `tokens` after `prompt` under the engine's model: one prefill, its own block table."""
    runner, device = engine.runner, engine.device
    ids = prompt + tokens
    n, block_size = len(ids), engine.config.cache.block_size
    num_blocks = -(-n // block_size)
    assert num_blocks <= runner.kv_caches[0].shape[1]
    meta = AttentionMetadata(
        torch.arange(n, device=device),
        torch.tensor([0, n], dtype=torch.int32, device=device),
        torch.tensor([n], dtype=torch.int32, device=device),
        torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        n,
        n,
    )
    with partial_sums.forward_pass():
        hidden = runner.model(torch.tensor(ids, device=device), torch.arange(n, device=device), runner.kv_caches, meta)
    logits = runner.model.compute_logits(hidden[len(prompt) - 1 : n - 1])
    chosen = torch.tensor(tokens, device=device)[:, None]
    return logits.log_softmax(-1).gather(1, chosen)[:, 0].tolist()


def param_count(shape: dict[str, Any]) -> int:
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    return 2 * shape["vocab_size"] * h + layers * per_layer + h


def measure_hardware() -> dict[str, float]:
    from bench.throughput import measure_hardware as measure

    return measure()


def floor_seconds(shape: dict[str, Any], args: argparse.Namespace, num_gpus: int, hw: dict[str, float]) -> dict:
    """performance.md's limit for the throughput workload, both GPUs' bandwidth and FLOPs together."""
    params = param_count(shape)
    weight_bytes = 2 * params
    kv_bytes = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 2
    out_len = args.output_len
    live_kv_tokens = args.num_requests * (args.prompt_len * out_len + out_len * (out_len - 1) // 2)
    decode = (out_len * weight_bytes + live_kv_tokens * kv_bytes) / (num_gpus * hw["copy_bytes_per_s"])
    prefill = 2 * params * args.num_requests * args.prompt_len / (num_gpus * hw["bf16_flops_per_s"])
    return {
        "params": params,
        "weight_bytes": weight_bytes,
        "prefill_s": round(prefill, 3),
        "decode_s": round(decode, 3),
        "total_s": round(prefill + decode, 3),
    }


def run_phase(phase: str, args: argparse.Namespace) -> dict[str, Any]:
    shape_name, variant = phase.split("-")
    shape_name = "tiny" if args.quick else shape_name
    model_dir = write_model_dir(shape_name, 131072)
    tp, dtype = (1, "float32") if variant == "fp32" else (int(variant[2:]), "bfloat16")
    start = sync(args.device)
    engine = Engine(engine_config(model_dir, args, tp, dtype))
    result: dict[str, Any] = {
        "phase": phase,
        "shape": shape_name,
        "tensor_parallel_size": tp,
        "custom_all_reduce": not args.disable_custom_all_reduce,
        "custom_all_reduce_max_bytes": args.custom_all_reduce_max_bytes,
        # configured (0 when off); at 4 / 8 ranks the engine caps it at 512 / 256 KiB (partial_sums.py)
        "fused_all_reduce_max_bytes": all_reduce_limits(engine.config.parallel)[1],
        "gemv_max_rows": engine.config.runner.gemv_max_rows,
        "pdl": engine.config.runner.pdl,
        "fused_all_reduce_push": engine.config.parallel.fused_all_reduce_push,
        "dtype": dtype,
        "startup_s": round(sync(args.device) - start, 1),
    }
    vocab = SHAPES[shape_name]["vocab_size"]
    prompts = correctness_prompts(vocab, args.quick)
    try:
        if phase == "8b-fp32":
            result["greedy"] = greedy_with_logprobs(engine, prompts, args.correctness_tokens)
            for other in ("8b-tp1", "8b-tp2"):
                path = args.work_dir / f"{other}.json"
                if path.exists():
                    runs = json.loads(path.read_text())["greedy"]
                    result[f"fp32_logprobs_of_{other}"] = [
                        teacher_forced_logprobs(engine, p, r["tokens"]) for p, r in zip(prompts, runs)
                    ]
        else:
            if shape_name != "70b" or args.quick:
                result["greedy"] = greedy_with_logprobs(engine, prompts, args.correctness_tokens)
            result["throughput"] = throughput(engine, args, vocab)
            result["itl"] = single_stream_itl(engine, args, vocab)
            if args.device == "cuda":
                result["peak_allocated_gib_rank0"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                hw = measure_hardware()
                result["hardware_per_gpu"] = {k: round(v / 1e12, 2) for k, v in hw.items()}  # TB/s, TFLOP/s
                floor = floor_seconds(SHAPES[shape_name], args, tp, hw)
                floor["fraction"] = round(floor["total_s"] / result["throughput"]["seconds"], 3)
                result["floor"] = floor
    finally:
        engine.shutdown()
    return result


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    tp1, tp2, ref = results.get("8b-tp1"), results.get("8b-tp2"), results.get("8b-fp32")
    if tp1 and tp2 and "greedy" in tp1 and "greedy" in tp2:
        summary["tp2_vs_tp1_first_divergence"] = [
            first_divergence(a["tokens"], b["tokens"]) for a, b in zip(tp1["greedy"], tp2["greedy"])
        ]
    for name, run in (("tp1", tp1), ("tp2", tp2)):
        if ref and run and f"fp32_logprobs_of_8b-{name}" in ref:
            errors = [
                abs(x - y)
                for r, fp32 in zip(run["greedy"], ref[f"fp32_logprobs_of_8b-{name}"])
                for x, y in zip(r["logprobs"], fp32)
            ]
            summary[f"{name}_vs_fp32_first_divergence"] = [
                first_divergence(r["tokens"], f["tokens"]) for r, f in zip(run["greedy"], ref["greedy"])
            ]
            summary[f"{name}_logprob_abs_error_vs_fp32"] = {
                "max": round(max(errors), 4),
                "mean": round(sum(errors) / len(errors), 5),
            }
    for name, run in results.items():  # other sizes (4 GPUs, ...) against one GPU
        if tp1 and name.startswith("8b-tp") and name not in ("8b-tp1", "8b-tp2") and "throughput" in run:
            size = name.removeprefix("8b-")
            summary[f"{size}_over_tp1_throughput"] = round(
                run["throughput"]["output_tokens_per_s"] / tp1["throughput"]["output_tokens_per_s"], 3
            )
            summary[f"{size}_over_tp1_itl_p50"] = round(run["itl"]["itl_ms_p50"] / tp1["itl"]["itl_ms_p50"], 3)
    if tp1 and tp2:
        summary["tp2_over_tp1_throughput"] = round(
            tp2["throughput"]["output_tokens_per_s"] / tp1["throughput"]["output_tokens_per_s"], 3
        )
        ratio = tp2["itl"]["itl_ms_p50"] / tp1["itl"]["itl_ms_p50"]
        summary["tp2_over_tp1_itl_p50"] = round(ratio, 3)
        summary["itl_target_met"] = ratio <= ITL_TARGET
    return summary


def table(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        "| phase | TP | dtype | out tok/s | ITL p50 ms | ITL mean ms | floor fraction | startup s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for phase, r in results.items():
        tput, itl = r.get("throughput", {}), r.get("itl", {})
        lines.append(
            f"| {phase} | {r['tensor_parallel_size']} | {r['dtype']} | {tput.get('output_tokens_per_s', '-')} "
            f"| {itl.get('itl_ms_p50', '-')} | {itl.get('itl_ms_mean', '-')} "
            f"| {r.get('floor', {}).get('fraction', '-')} | {r['startup_s']} |"
        )
    lines += ["", *(f"- {k}: {v}" for k, v in summary.items())]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--phase", help=argparse.SUPPRESS)  # internal: run one phase in this process
    parser.add_argument("--work-dir", type=Path, help="where phases leave their JSON (default: a new temp dir)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--itl-tokens", type=int, default=256)
    parser.add_argument("--correctness-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--cuda-graph-max-batch", type=int, default=512, help="0: no CUDA graphs (eager decode)")
    parser.add_argument(
        "--disable-custom-all-reduce", action="store_true", help="TP all-reduces by NCCL only (the engine's flag)"
    )
    parser.add_argument(
        "--custom-all-reduce-max-bytes",
        type=int,
        default=0,
        help="the engine's flag: >0 turns on the symmetric-memory all-reduce (torch's one/two-shot kernels)",
    )
    parser.add_argument("--gemv-max-rows", type=int, help="the engine's flag (default: the engine's); 0: cuBLAS only")
    parser.add_argument("--pdl", type=int, choices=(0, 1), help="programmatic dependent launch (default: the engine's)")
    parser.add_argument(
        "--fused-push", type=int, choices=(0, 1), help="the fused all-reduce's push protocol (default: the engine's)"
    )
    parser.add_argument(
        "--fused-all-reduce-max-bytes",
        type=int,
        help="the engine's flag (default: the engine's, on): 0 all-reduces o/down outputs by NCCL before the norm",
    )
    parser.add_argument("--phase-timeout-s", type=float, default=540, help="a phase running longer is killed")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 8, 32, 16
        args.itl_tokens, args.correctness_tokens, args.max_model_len = 16, 8, 256
    return args


def main() -> None:
    args = parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.phase:  # a child: one phase, its JSON into the work dir
        if args.device == "cpu":
            torch.set_num_threads(1)
        result = run_phase(args.phase, args)
        (args.work_dir / f"{args.phase}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        os._exit(0)  # no NCCL teardown at exit (see parallel/state.shutdown_parallel)
    # Phases read each other's JSON here (8b-fp32 scores the bf16 runs' tokens): pass --work-dir to
    # run phases in separate invocations and still get one report.
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="pagedserve-tp-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    for phase in [p for p in args.phases.split(",") if p]:
        if not re.fullmatch(r"(8b|70b)-tp\d+|8b-fp32", phase):
            sys.exit(f"unknown phase {phase!r}: <8b|70b>-tp<N> or 8b-fp32")
        print(f"== {phase}", flush=True)
        start = time.perf_counter()
        command = [
            sys.executable,
            "-m",
            "bench.tensor_parallel",
            *sys.argv[1:],
            "--phase",
            phase,
            "--work-dir",
            str(work_dir),
        ]
        try:
            returncode = subprocess.run(command, env=os.environ.copy(), timeout=args.phase_timeout_s).returncode
        except subprocess.TimeoutExpired:
            returncode = -1  # run kills the child; its worker rank follows (it watches its parent)
        status = "done" if returncode == 0 else f"FAILED (exit {returncode})"
        print(f"   {phase} {status} in {time.perf_counter() - start:.0f} s", flush=True)
    results = {p.stem: json.loads(p.read_text()) for p in sorted(work_dir.glob("*b-*.json"))}
    summary = summarize(results)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.tensor_parallel " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "num_gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
        "torch": torch.__version__,
        "results": results,
        "summary": summary,
    }
    text = table(results, summary)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"tensor_parallel_{args.device}{'_quick' if args.quick else ''}"
    stem += "_nccl_all_reduce" if args.disable_custom_all_reduce else ""
    stem += f"_symm{args.custom_all_reduce_max_bytes}" if args.custom_all_reduce_max_bytes else ""
    stem += "_unfused" if args.fused_all_reduce_max_bytes == 0 or args.disable_custom_all_reduce else ""
    stem += f"_gemv{args.gemv_max_rows}" if args.gemv_max_rows is not None else ""
    stem += f"_pdl{args.pdl}" if args.pdl is not None else ""
    stem += f"_push{args.fused_push}" if args.fused_push is not None else ""
    (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (args.out_dir / f"{stem}.md").write_text(
        f"# {report['command']}\n{report['date']} on {report['device']}\n\n{text}\n"
    )
    print(f"wrote {args.out_dir / stem}.json and .md")


if __name__ == "__main__":
    main()
