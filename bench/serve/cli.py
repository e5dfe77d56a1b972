"""`python -m bench.serve`: the command line, and the order of the runs.

    warm-up -> main run (--request-rate, --max-concurrency) -> single stream (--single-stream N)
    -> concurrency sweep (--concurrency-sweep 1,8,64) ; --offline: the engine alone first

Every run gets its own prompts (seed + k), so no run hits prefix-cache entries an earlier one left.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import socket
import sys
from pathlib import Path
from typing import Any

from bench.serve import datasets, report
from bench.serve.client import ClientConfig, RequestResult
from bench.serve.load import LoadSpec, run_load
from bench.serve.metrics import summarize

SINGLE_SEED, WARMUP_SEED, SWEEP_SEED = 1, 2, 100  # added to --seed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name requests carry")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None, help="a local tokenizer (HF dir or name), not the server's /tokenize")
    p.add_argument("--dataset", choices=["random", "chat-mix"], default="random")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--length-dist", choices=["fixed", "uniform", "normal"], default="fixed")
    p.add_argument("--range-ratio", type=float, default=0.25, help="spread of uniform/normal lengths, and chat-mix")
    p.add_argument("--prompt-format", choices=["ids", "text"], default="ids", help="chat always sends text")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson requests/s; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-processes", type=int, default=1, help="spread the client over N processes")
    p.add_argument("--concurrency-sweep", default="", help="e.g. 1,8,64,256: one run per max concurrency")
    p.add_argument("--sweep-num-prompts", type=int, default=None, help="default: 4 x concurrency, within [16, N]")
    p.add_argument(
        "--single-stream", type=int, default=None, help="requests sent one at a time (default 0, 16 with --offline)"
    )
    p.add_argument("--warmup-requests", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--device-label", default=None, help="the server's device, for the report (e.g. 'H100 80GB')")
    p.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    p.add_argument("--result-name", default=None, help="file stem (default serve_<model>[_quick])")
    p.add_argument("--save-requests", action="store_true", help="every request's timings in the JSON")
    p.add_argument("--quick", action="store_true", help="a tiny run: 8 requests x 32 prompt x 8 output tokens")
    offline = p.add_argument_group("offline engine (--offline)")
    offline.add_argument("--offline", action="store_true", help="also run the engine alone on the same prompts")
    offline.add_argument("--offline-only", action="store_true", help="only the engine (needs --tokenizer)")
    offline.add_argument(
        "--offline-from",
        type=Path,
        default=None,
        help="a result JSON of an --offline-only run "
        "on the same prompts (the engine alone, without the server sharing its GPU)",
    )
    offline.add_argument("--offline-model-dir", default=None, help="default: --tokenizer, else --model")
    offline.add_argument("--offline-shape", default=None, help="random bf16 weights of a bench/throughput.py shape")
    offline.add_argument("--offline-device", default=None, help="default cuda when available")
    offline.add_argument("--offline-dtype", default="auto")
    offline.add_argument(
        "--offline-cuda-graph-max-tokens",
        type=int,
        default=None,
        help="mixed/prefill steps of up to this many tokens replay CUDA graphs (default: the engine's)",
    )
    offline.add_argument(
        "--offline-profile-steps",
        action="store_true",
        help="time the offline engine's step phases (its JSON gets them; adds CUDA events to every step)",
    )
    offline.add_argument("--offline-max-num-seqs", type=int, default=256)
    offline.add_argument("--offline-max-num-batched-tokens", type=int, default=8192)
    offline.add_argument("--offline-max-model-len", type=int, default=2048)
    offline.add_argument(
        "--offline-gpu-memory-utilization",
        type=float,
        default=0.9,
        help="as the engine's; a server on the same GPU counts as memory in use",
    )
    offline.add_argument("--offline-cpu-threads", type=int, default=None, help="CPU: torch threads (shared cores: 1)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = min(args.num_prompts, 8), 32, 8
        args.warmup_requests = min(args.warmup_requests, 1)
    args.offline = args.offline or args.offline_only
    if args.single_stream is None:
        args.single_stream = (2 if args.quick else 16) if (args.offline or args.offline_from) else 0
    if not args.url and not args.offline_only:
        p.error("--url is required (unless --offline-only)")
    if args.offline_only and not args.tokenizer:
        p.error("--offline-only needs --tokenizer (no server to tokenize with)")
    if args.offline and args.offline_from:
        p.error("--offline and --offline-from exclude each other")
    if args.offline_device is None and args.offline:
        import torch  # only the offline engine needs it

        args.offline_device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def sweep_levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sweep_num_prompts(args: argparse.Namespace, level: int) -> int:
    if args.sweep_num_prompts:
        return args.sweep_num_prompts
    return max(min(4 * level, args.num_prompts), min(16, args.num_prompts), level)


def environment(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "client_host": f"{socket.gethostname()} ({platform.machine()}, python {platform.python_version()})",
        "device": args.device_label,
        # a server started beside the benchmark (bench/serve_gpu.sh) takes its engine settings from these
        "pagedserve_env": {k: v for k, v in os.environ.items() if k.startswith("PAGEDSERVE_")},
        "command": "python -m bench.serve " + " ".join(sys.argv[1:] if argv is None else argv),
    }


def samples_ms(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.ok]
    return {"ttft_ms": [r.ttft * 1e3 for r in ok], "itl_ms": [gap * 1e3 for r in ok for gap in r.itl]}


def load_offline(path: Path, fingerprints: dict[str, str]) -> dict[str, Any]:
    earlier = json.loads(path.read_text())
    for key, value in fingerprints.items():
        if earlier["workload"].get(key) != value:
            raise SystemExit(f"{path}: its prompts ({key}) differ from this run's; use the same dataset options")
    return dict(earlier["offline"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    client = ClientConfig(
        args.url or "",
        args.model,
        args.endpoint,
        args.temperature,
        args.ignore_eos,
        args.api_key,
        args.extra_body,
        args.timeout,
    )
    if args.tokenizer:
        source = datasets.TokenSource.local(args.tokenizer)
    else:
        source = datasets.TokenSource.server(client.base_url, args.model, client.headers)
    as_text = args.endpoint == "chat" or args.prompt_format == "text"

    def make(num: int, seed: int) -> list[datasets.BenchRequest]:
        return datasets.build(
            source,
            args.dataset,
            num,
            args.input_len,
            args.output_len,
            args.length_dist,
            args.range_ratio,
            args.seed + seed,
            as_text,
        )

    main_set, single_set = make(args.num_prompts, 0), make(args.single_stream, SINGLE_SEED)
    result: dict[str, Any] = {
        "url": args.url,
        "model": args.model,
        "environment": environment(args, argv),
        "workload": {
            "dataset": args.dataset,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "length_dist": args.length_dist,
            "range_ratio": args.range_ratio,
            "endpoint": args.endpoint,
            "prompt_format": "text" if as_text else "ids",
            "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "client_processes": args.client_processes,
            "seed": args.seed,
            "fingerprint": datasets.fingerprint(main_set),
            "single_fingerprint": datasets.fingerprint(single_set),
        },
        "runs": {},
    }
    if args.offline:
        from bench.serve.offline import run_offline

        result["offline"] = run_offline(args, main_set, single_set)
    elif args.offline_from and not args.offline_from.exists():  # a fresh machine that ran PHASES=served only
        print(f"no offline result at {args.offline_from}: no pipeline-tax comparison in this report")
    elif args.offline_from:
        keys = ("fingerprint", "single_fingerprint")
        result["offline"] = load_offline(args.offline_from, {k: result["workload"][k] for k in keys})
    samples: dict[str, dict[str, list[float]]] = {}
    if not args.offline_only:
        run_served(args, client, make, main_set, single_set, result, samples)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", args.model)
    name = args.result_name or f"serve_{slug}" + ("_quick" if args.quick else "")
    path = report.write(result, samples, args.result_dir, name)
    print(report.markdown(result))
    print(f"wrote {path}")
    return result


def run_served(
    args: argparse.Namespace,
    client: ClientConfig,
    make: Any,
    main_set: list[datasets.BenchRequest],
    single_set: list[datasets.BenchRequest],
    result: dict[str, Any],
    samples: dict[str, dict[str, list[float]]],
) -> None:
    slo = (args.slo_ttft_ms, args.slo_tpot_ms)
    if args.warmup_requests:
        warm = run_load(client, make(args.warmup_requests, WARMUP_SEED), LoadSpec())
        if not any(r.ok for r in warm):
            raise SystemExit(f"every warm-up request failed: {warm[0].error}")
    spec = LoadSpec(args.request_rate, args.max_concurrency, args.seed, args.client_processes)
    main_results = run_load(client, main_set, spec)
    result["runs"]["main"] = summarize(main_results, *slo)
    samples["main"] = samples_ms(main_results)
    if args.save_requests:
        result["requests"] = [r.to_dict() for r in main_results]
    print(f"main: {json.dumps(result['runs']['main'])}", flush=True)
    single = None
    if single_set:
        single_results = run_load(client, single_set, LoadSpec(max_concurrency=1))
        single = result["runs"]["single stream"] = summarize(single_results, *slo)
        samples["single stream"] = samples_ms(single_results)
        print(f"single stream: {json.dumps(single)}", flush=True)
    sweep = []
    for i, level in enumerate(sweep_levels(args.concurrency_sweep)):
        requests = make(sweep_num_prompts(args, level), SWEEP_SEED + i)
        procs = min(args.client_processes, level)
        level_results = run_load(client, requests, LoadSpec(max_concurrency=level, client_processes=procs))
        sweep.append({"max_concurrency": level, **summarize(level_results, *slo)})
        samples[f"concurrency {level}"] = samples_ms(level_results)
        print(
            f"concurrency {level}: {sweep[-1]['output_throughput']} out tok/s, TTFT p50 "
            f"{sweep[-1]['ttft_ms']['p50']} ms, failed {sweep[-1]['failed']}",
            flush=True,
        )
    if sweep:
        result["sweep"] = sweep
    if "offline" in result:
        from bench.serve.offline import pipeline_tax

        result["pipeline_tax"] = pipeline_tax(result["offline"], result["runs"]["main"], single)
