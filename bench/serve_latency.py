"""Time to first token and decode speed of single streaming requests through the real services.

    python -m bench.serve_latency                       # starts Redis + services for the default model
    python -m bench.serve_latency --url http://host:8000 # measures a running server

Prints a table and writes JSON to bench/results/serve_latency_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import openai

from bench.servers import start_servers

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a CPU does.",
    "List three fruits.",
    "Why is the sky blue?",
]


def measure(base_url: str, model: str, max_tokens: int) -> list[dict[str, float]]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=600)
    rows = []
    for prompt in PROMPTS:
        start = time.perf_counter()
        first = None
        usage = None
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
        end = time.perf_counter()
        assert first is not None and usage is not None
        rows.append(
            {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "ttft_s": first - start,
                "decode_tok_s": (usage.completion_tokens - 1) / max(end - first, 1e-9),
                "e2e_s": end - start,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    servers = None if args.url else start_servers(["--cpu-threads", str(args.cpu_threads)])
    url = args.url if servers is None else servers.base_url
    try:
        measure(url, args.model, 4)  # warm-up
        rows = measure(url, args.model, args.max_tokens)
    finally:
        if servers is not None:
            servers.stop()
    print(f"{'prompt':>6} {'ttft ms':>8} {'decode tok/s':>13} {'tokens':>7}")
    for i, row in enumerate(rows):
        print(f"{i:>6} {row['ttft_s'] * 1000:>8.0f} {row['decode_tok_s']:>13.1f} {row['completion_tokens']:>7}")
    summary = {
        "median_ttft_ms": statistics.median(r["ttft_s"] for r in rows) * 1000,
        "median_decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows),
    }
    print(f"median  {summary['median_ttft_ms']:>8.0f} {summary['median_decode_tok_s']:>13.1f}")
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}",
        "model": args.model,
        "max_tokens": args.max_tokens,
        "cpu_threads": args.cpu_threads,
        "rows": rows,
        **summary,
    }
    out = Path("bench/results/serve_latency_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
