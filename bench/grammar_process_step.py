"""The grammar processes' round trip for one step: post a step's tokens and fill list, collect the reply.

256 json_schema matchers (the structured-throughput bench's schema) follow one JSON answer token by token. Each step
posts (accept every row's token, fill every row's mask) and waits for the reply, as the engine thread would if it
had nothing else to do. Reported per number of processes: the round trip's median and mean, and the children's own
timings (the slowest child's median work). Only the host matters here: no GPU needed.

    python -m bench.grammar_process_step --tokenizer /path/to/SmolLM2-135M-Instruct [--processes 1,2,4]
Writes grammar_process_step_<host>.json under --out-dir (default bench/results/grammar_process_step/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from bench.structured_throughput import SCHEMA
from pagedserve.services.engine.structured.compiler import GrammarCompilerPool
from pagedserve.services.engine.structured.grammar_process import GrammarProcess
from pagedserve.shared.grammar_spec import GrammarSpec
from pagedserve.shared.tokenizer_loader import load_tokenizer

# One answer the schema accepts: the rows' tokens visit keys, strings, numbers and enums.
ANSWER = '{"rows":[' + ",".join(
    f'{{"id":{i},"name":"item {i} of the list","score":{i}.25,"tag":"{("alpha", "beta", "gamma")[i % 3]}"}}'
    for i in range(6)
)


def round_trips(process: GrammarProcess, ids: list[int], answer: list[int], rows: int) -> list[float]:
    fill = [(row, ids[row]) for row in range(rows)]
    times = []
    for step, token_id in enumerate(answer):
        start = time.perf_counter()
        ticket = process.post_step(ids, [token_id] * rows, step % 2, fill, time.monotonic())
        ended = process.collect_step(ticket)
        times.append(time.perf_counter() - start)
        assert not ended, f"the answer left the grammar at token {step}: {ended}"
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results" / "grammar_process_step")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    vocab_size = 49152  # SmolLM2's
    pool = GrammarCompilerPool(tokenizer, vocab_size, [tokenizer.eos_token_id])
    spec = GrammarSpec.json_schema(SCHEMA)
    compiled = pool.submit(spec).result()
    answer = list(tokenizer.encode(ANSWER, add_special_tokens=False))
    results: list[dict[str, Any]] = []
    for count in map(int, args.processes.split(",")):
        process = GrammarProcess(pool.tokenizer_info, vocab_size, args.rows, pin=False, num_children=count)
        ids = [process.open(spec, compiled, None) for _ in range(args.rows)]
        times = round_trips(process, ids, answer, args.rows)
        children = process.step_timings()
        process.shutdown()
        row = {
            "processes": count,
            "rows": args.rows,
            "steps": len(times),
            "round_trip_ms_median": round(1e3 * statistics.median(times), 3),
            "round_trip_ms_mean": round(1e3 * statistics.mean(times), 3),
            "slowest_child_work_ms_median": children["work_ms"],
        }
        results.append(row)
        print(json.dumps(row), flush=True)
    host = platform.node() or "host"
    report = {
        "environment": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": host,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "processor": platform.processor(),
            "command": "python -m bench.grammar_process_step " + " ".join(f"{k}={v}" for k, v in vars(args).items()),
        },
        "results": results,
    }
    print("\n| processes | rows | steps | round trip ms median / mean | slowest child's work ms (median) |")
    print("|---:|---:|---:|---|---:|")
    for row in results:
        print(
            f"| {row['processes']} | {row['rows']} | {row['steps']} | {row['round_trip_ms_median']} / "
            f"{row['round_trip_ms_mean']} | {row['slowest_child_work_ms_median']} |"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"grammar_process_step_{host}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
