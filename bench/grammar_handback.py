"""The grammar worker's hand-back to an engine thread that is busy in Python (issue 23's structured output).

The engine thread submits a step's grammar work (advance 128 json_schema matchers by a token, fill their masks)
to the mask worker, runs `--engine-ms` of pure Python (what a host-bound step does between kernels), then joins.
The worker's xgrammar calls run without the GIL, but the Python around them needs it back from the busy engine
thread; how long that takes is Python's switch interval. Reported: the join's wait (the grammar work left on the
critical path) and the whole step, per switch interval and fill-thread count. Any machine; no GPU needed.

    python -m bench.grammar_handback [--rows 128] [--engine-ms 2] [--steps 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from bench.structured_throughput import SCHEMA
from pagedserve.services.engine.structured import mask_worker
from pagedserve.services.engine.structured.mask_worker import MaskWorker
from pagedserve.services.engine.structured.state import GrammarState, accept_all

VOCAB = 49152  # the SmolLM2 tokenizer's
PREFIX = '{"rows": [{"id": 12, "name": "abc", "score": 1.5, "tag": "alpha"}, {"id": 3'  # tokens the grammar accepts


def busy_python(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        sum(i for i in range(50))


def measure(
    compiled: Any, tokens: list[int], args: argparse.Namespace, interval: float, threads: int
) -> dict[str, Any]:
    sys.setswitchinterval(0.005)  # Python's default; the worker lowers it to SWITCH_INTERVAL_S when it starts
    mask_worker.SWITCH_INTERVAL_S, mask_worker.FILL_THREADS = interval, threads
    done: Future[Any] = Future()
    done.set_result(compiled)
    grammars = [GrammarState(done) for _ in range(args.rows)]
    assert all(g.is_ready for g in grammars)
    worker = MaskWorker(VOCAB, args.rows, torch.device("cpu"))
    waits, steps = [], []
    for step in range(args.steps + 5):
        position = step % len(tokens)
        if position == 0:  # back to the start of the prefix: every matcher walks the same states again
            for grammar in grammars:
                grammar.matcher.reset()

        def accept(position: int = position) -> list[bool]:
            return accept_all(grammars, [tokens[position]] * args.rows)

        start = time.perf_counter()
        task = worker.submit(accept, list(enumerate(grammars)))
        busy_python(args.engine_ms)
        joining = time.perf_counter()
        accepted, _ = task.join()
        end = time.perf_counter()
        assert all(accepted), "the prefix left the grammar"
        if step >= 5:  # the first steps start the thread and allocate the buffers
            waits.append((end - joining) * 1e3)
            steps.append((end - start) * 1e3)
    worker.shutdown()
    return {
        "switch_interval_ms": interval * 1e3,
        "fill_threads": threads,
        "join_wait_ms_p50": round(statistics.median(waits), 3),
        "join_wait_ms_p90": round(statistics.quantiles(waits, n=10)[-1], 3),
        "step_ms_p50": round(statistics.median(steps), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, default=Path("build/smollm2-tokenizer"))
    parser.add_argument("--rows", type=int, default=128, help="json_schema sequences in the step")
    parser.add_argument("--engine-ms", type=float, default=2.0, help="the engine thread's Python before it joins")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--intervals-ms", default="5,0.5")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)).compile_json_schema(
        json.dumps(SCHEMA)
    )
    tokens = tokenizer.encode(PREFIX, add_special_tokens=False)
    print(f"{args.rows} json_schema rows, {args.engine_ms} ms of engine-thread Python a step, {args.steps} steps")
    print(f"{'switch ms':>9} {'threads':>7} {'join p50':>9} {'join p90':>9} {'step p50':>9}")
    rows = []
    for interval in (float(i) / 1e3 for i in args.intervals_ms.split(",")):
        for threads in (int(t) for t in args.threads.split(",")):
            r = measure(compiled, tokens, args, interval, threads)
            rows.append(r)
            print(
                f"{r['switch_interval_ms']:9.1f} {threads:7d} {r['join_wait_ms_p50']:9.3f} "
                f"{r['join_wait_ms_p90']:9.3f} {r['step_ms_p50']:9.3f}",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"args": vars(args), "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0]}
        args.json.write_text(json.dumps(report | {"rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
