"""Does xgrammar release the GIL in the calls the grammar worker makes? (issue 23's structured output)

The mask worker (services/engine/structured/mask_worker.py) advances a step's matchers and fills their masks on
a thread beside the engine thread. That only takes the work off the step if the calls run without the GIL.
Here a pure-Python spinner thread counts while the main thread makes one call (`batch_accept_token`,
`batch_fill_next_token_bitmask`, and the one-matcher `accept_token` / `fill_next_token_bitmask` in a loop; and the
engine's accept, `matcher_calls.batch_accept`, which keeps the GIL) over `--rows` json_schema matchers. The
spinner's progress during the call, as a share of its rate alone, says how much of the call another Python thread
could use: about 100% = GIL released, about 0% = GIL held throughout. The three accepts take turns over the
text's tokens (each a third of them), the fills run at every token.

    python -m bench.xgrammar_gil --tokenizer DIR [--rows 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.structured_throughput import SCHEMA
from pagedserve.services.engine.structured import matcher_calls

VOCAB = 49152  # the SmolLM2 tokenizer's
TEXT = '{"rows": [{"id": 12, "name": "abc", "score": 1.5, "tag": "alpha"}, {"id": 3, "name": "de", "score": 2'


class Spinner:
    """A thread counting in Python; `rate()` is its count per second over a window."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self._stop:
            self.count += 1

    def __enter__(self) -> Spinner:
        self._thread.start()
        time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()

    def progress_during(self, call: Callable[[int], Any], token: int) -> tuple[float, int]:
        """(seconds `call(token)` took, spinner counts during it)."""
        start_count, start = self.count, time.perf_counter()
        call(token)
        return time.perf_counter() - start, self.count - start_count


def solo_rate() -> float:
    with Spinner() as spinner:
        start_count = spinner.count
        time.sleep(0.2)
        return (spinner.count - start_count) / 0.2


def measure(tokenizer_dir: Path, rows: int) -> dict[str, dict[str, float]]:
    """Each call's time alone, then beside the spinner (fresh matchers, the same tokens), and the spinner's share."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from xgrammar.matcher import _core

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)).compile_json_schema(
        json.dumps(SCHEMA)
    )
    token_ids = tokenizer.encode(TEXT)
    rate = solo_rate()

    def run_pass(spinner: Spinner | None) -> dict[str, list[tuple[float, float]]]:
        """Per call name: (ms, spinner share) of each call; every matcher takes the same text, token by token."""
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        bitmask = torch.full(xgr.get_bitmask_shape(rows, VOCAB), -1, dtype=torch.int32)
        batch = xgr.BatchGrammarMatcher(max_threads=1)
        raw_accept: Any = _core.BatchGrammarMatcher.batch_accept_token  # the Function both accepts below call

        def xgrammar_accept(token: int) -> list[bool]:
            raw_accept.release_gil = True  # tvm-ffi's default (matcher_calls.batch_accept turns it off)
            return xgr.BatchGrammarMatcher.batch_accept_token(matchers, [token] * rows)

        def engine_accept(token: int) -> list[bool]:
            raw_accept.release_gil = False
            return matcher_calls.batch_accept(matchers, [token] * rows)

        calls: dict[str, Callable[[int], Any]] = {
            "batch_accept_token": xgrammar_accept,
            "matcher_calls.batch_accept": engine_accept,
            "batch_fill_next_token_bitmask": lambda _: batch.batch_fill_next_token_bitmask(matchers, bitmask, None),
            "accept_token (loop)": lambda token: [m.accept_token(token) for m in matchers],
            "fill_next_token_bitmask (loop)": lambda _: [
                m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)
            ],
            "control: time.sleep(0.2 ms)": lambda _: time.sleep(0.0002),  # releases the GIL once
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
        for step, token in enumerate(token_ids):
            names = ["batch_fill_next_token_bitmask", "fill_next_token_bitmask (loop)"]
            names.append(("batch_accept_token", "accept_token (loop)", "matcher_calls.batch_accept")[step % 3])
            names.append("control: time.sleep(0.2 ms)")
            for name in names:
                if spinner is None:
                    start = time.perf_counter()
                    calls[name](token)
                    results[name].append(((time.perf_counter() - start) * 1e3, 0.0))
                else:
                    seconds, counts = spinner.progress_during(calls[name], token)
                    results[name].append((seconds * 1e3, counts / seconds / rate))
        return results

    alone = run_pass(None)
    with Spinner() as spinner:
        beside = run_pass(spinner)
    return {
        name: {
            "calls": len(beside[name]),
            "ms_alone_median": round(statistics.median(ms for ms, _ in alone[name]), 3),
            "ms_beside_spinner_median": round(statistics.median(ms for ms, _ in beside[name]), 3),
            "spinner_share_median": round(statistics.median(share for _, share in beside[name]), 3),
        }
        for name in beside
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory with the SmolLM2 tokenizer")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--switch-interval-ms", type=float, default=0.5, help="as the mask worker sets it")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    import xgrammar as xgr

    results = measure(args.tokenizer, args.rows)
    print(f"{args.rows} json_schema matchers, switch interval {args.switch_interval_ms} ms: each call alone, beside a")
    print("busy Python thread, and that thread's progress during the call (share of its rate alone)")
    print(f"{'call':34} {'calls':>5} {'ms alone':>9} {'ms beside':>10} {'spinner share':>14}")
    for name, r in results.items():
        print(
            f"{name:34} {r['calls']:>5} {r['ms_alone_median']:>9.3f} {r['ms_beside_spinner_median']:>10.3f} "
            f"{r['spinner_share_median']:>13.0%}"
        )
    if args.json:
        version = getattr(xgr, "__version__", None)
        if version is None:
            from importlib.metadata import version as dist_version

            version = dist_version("xgrammar")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "rows": args.rows,
            "switch_interval_ms": args.switch_interval_ms,
            "xgrammar": version,
            "calls": results,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
