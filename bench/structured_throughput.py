"""Structured output's cost: json_schema requests mixed 50/50 with plain ones, and all json_schema.

On each shape (random weights, as bench/throughput.py builds them; the SmolLM2 tokenizer gives the
grammar its vocabulary), through the offline Engine at 256 concurrency, three runs of the same shape
of work (every sequence prompt_len in, output_len out):
  all_plain  256 plain requests (greedy, ignore_eos)
  mixed      128 plain + 128 json_schema requests (a schema of >= 64 rows, so no grammar can finish
             before output_len: the runs hold the same number of sequences for the same steps)
  all_json   256 json_schema requests
Reported: the plain requests' throughput in each run (their output tokens over the time until the
last of them finished, per plain request and in all) and its ratio; all_json's output tokens/s against
all_plain's (issue 23's goal for both: >= 0.9); steps/s, and
the grammar's per-step cost: the worker thread's time per grammar step (`worker`: waiting for the last
step's tokens, advancing the matchers by them, of which `accept` is the matcher calls, and filling the
bitmask of the step's grammar rows; all of it beside the engine thread's launch; with the grammar process
(--grammar-processes N) only the wait for the tokens and their post to the process, and `accept` is not
measured), the time the engine thread then still waits for it before sampling (`join`: the grammar work left
on the critical path; with the grammar process, its own medians too: `handover`, from the engine thread's
hand-over to the worker's post, `post_to_start` and the child's `work`), and
the device time of applying the mask to [256, vocab] logits (`apply`, timed alone with CUDA events).

    python -m bench.structured_throughput --tokenizer /path/to/SmolLM2-135M-Instruct
    python -m bench.structured_throughput --quick --models smollm2-135m --tokenizer ...
Writes structured_throughput_<device>[_quick].json under --out-dir (default bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.throughput import CUDA, SHAPES, build_models, engine_config, free_memory, make_prompts
from pagedserve.services.engine import engine as engine_module
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.structured import grammar_process, mask_worker, matcher_calls
from pagedserve.services.engine.structured.bitmask import TokenBitmask, apply_token_bitmask
from pagedserve.services.engine.structured.mask_worker import GrammarTask, MaskWorker, RemoteGrammarTask
from pagedserve.shared.grammar_spec import GrammarSpec

ROW = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "score": {"type": "number"},
        "tag": {"enum": ["alpha", "beta", "gamma"]},
    },
    "required": ["id", "name", "score", "tag"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"rows": {"type": "array", "items": ROW, "minItems": 64}},
    "required": ["rows"],
    "additionalProperties": False,
}
TARGET_RATIO = 0.9  # issue 23: json_schema throughput >= 0.9x unconstrained


class AcceptTimer:
    """Wraps the engine's advance of a step's grammar rows by their tokens, summing its host time."""

    def __init__(self) -> None:
        self.real = engine_module._grammar_ends_of
        self.total_s = 0.0

    def __call__(self, rows: Any, token_ids: list[int], num_rows: int) -> list[bool]:
        start = time.perf_counter()
        ends = self.real(rows, token_ids, num_rows)
        self.total_s += time.perf_counter() - start
        return ends


class WorkerTimer:
    """Wraps the mask worker's task (on its thread: the whole grammar work, or with grammar processes the wait for
    the tokens and the post, when the worker makes it: tokens already on the host are posted by the engine thread)
    and the engine thread's join of it, timing both."""

    def __init__(self) -> None:
        self.real_run, self.real_post = MaskWorker._run, MaskWorker._post
        self.real_joins = {cls: cls.join for cls in (GrammarTask, RemoteGrammarTask)}
        self.worker_ms: list[float] = []
        self.join_ms: list[float] = []

    def install(self) -> None:
        timer = self

        def timed(real: Any) -> Any:
            def call(worker: MaskWorker, *args: Any) -> Any:
                start = time.perf_counter()
                out = real(worker, *args)
                timer.worker_ms.append((time.perf_counter() - start) * 1e3)
                return out

            return call

        def timed_join(real: Any) -> Any:
            def join(task: Any) -> Any:
                first, start = task._joined is None, time.perf_counter()
                out = real(task)
                if first:
                    timer.join_ms.append((time.perf_counter() - start) * 1e3)
                return out

            return join

        MaskWorker._run = timed(self.real_run)  # type: ignore[method-assign]
        MaskWorker._post = timed(self.real_post)  # type: ignore[method-assign]
        for cls, real in self.real_joins.items():
            cls.join = timed_join(real)  # type: ignore[method-assign]

    def remove(self) -> None:
        MaskWorker._run = self.real_run  # type: ignore[method-assign]
        MaskWorker._post = self.real_post  # type: ignore[method-assign]
        for cls, real in self.real_joins.items():
            cls.join = real  # type: ignore[method-assign]


def run(engine: Engine, prompts: list[list[int]], output_len: int, num_json: int) -> dict[str, Any]:
    plain = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, structured_output=GrammarSpec.json_schema(SCHEMA)
    )
    n = len(prompts)  # num_json of them constrained, spread evenly (every other one at n / 2)
    is_json = {f"r{i}": (i * num_json) // n != ((i + 1) * num_json) // n for i in range(n)}
    counts = dict.fromkeys(is_json, 0)
    done_at: dict[str, float] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, constrained if is_json[f"r{i}"] else plain)
    while engine.has_unfinished():
        for out in engine.step():
            counts[out.request_id] += len(out.new_token_ids)
            if out.finish_reason is not None:
                done_at[out.request_id] = time.perf_counter() - start
    seconds = time.perf_counter() - start
    plain_ids = [r for r, j in is_json.items() if not j]
    assert all(counts[r] == output_len for r in counts), "every sequence runs to output_len"
    result: dict[str, Any] = {
        "requests": len(prompts),
        "json_requests": sum(is_json.values()),
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(sum(counts.values()) / seconds, 1),
        "steps": engine.stats().num_steps,
        "profile_per_step": engine.profile.summary(),
    }
    if plain_ids:
        plain_tokens, plain_seconds = sum(counts[r] for r in plain_ids), max(done_at[r] for r in plain_ids)
        result |= {
            "plain_output_tokens": plain_tokens,
            "plain_seconds": round(plain_seconds, 3),
            "plain_tokens_per_s": round(plain_tokens / plain_seconds, 1),
            "plain_tokens_per_s_per_request": round(statistics.mean(output_len / done_at[r] for r in plain_ids), 2),
        }
    return result


def apply_cost_ms(vocab_size: int, rows: int) -> float:
    """Device time of one apply_token_bitmask on [rows, vocab] fp32 logits (half the rows constrained),
    after checking that the device result equals the CPU one on a random bitmask."""
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(0)
    host_logits = torch.randn(rows, vocab_size, generator=generator)
    host_bits = torch.randint(
        -(2**31), 2**31 - 1, xgr.get_bitmask_shape(rows, vocab_size), generator=generator, dtype=torch.int64
    ).to(torch.int32)
    indices = list(range(0, rows, 2))
    expected = host_logits.clone()
    apply_token_bitmask(expected, TokenBitmask(host_bits, indices))
    logits = host_logits.to(CUDA)
    apply_token_bitmask(logits, TokenBitmask(host_bits.to(CUDA), indices))
    assert torch.equal(logits.cpu(), expected), "the bitmask on CUDA differs from the CPU result"
    bitmask = host_bits.to(CUDA)
    for _ in range(3):
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    print(f"== {name}", flush=True)
    hf, ours, model_dir = build_models(name, args.max_model_len)
    del hf
    free_memory()
    vocab = SHAPES[name]["vocab_size"]
    prompts = make_prompts(args.num_requests, args.prompt_len, vocab, seed=0)
    row: dict[str, Any] = {"model": name}
    runs = [("all_plain", 0), ("mixed", args.num_requests // 2), ("all_json", args.num_requests)]
    if args.repeat_plain:
        runs.append(("all_plain_again", 0))
    for label, num_json in runs:
        config = engine_config(model_dir, args, tokenizer=args.tokenizer, grammar_processes=args.grammar_processes)
        engine = Engine(config, model=ours)
        if num_json:  # compile once before timing (cached by schema, as a server would have it)
            engine.grammars.pool.submit(GrammarSpec.json_schema(SCHEMA)).result()
        timer, accept = WorkerTimer(), AcceptTimer()
        timer.install()
        engine_module._grammar_ends_of = accept
        try:
            row[label] = run(engine, prompts, args.output_len, num_json)
        finally:
            timer.remove()
            engine_module._grammar_ends_of = accept.real
        if engine.grammars.process is not None:
            row[label]["grammar_process_ms"] = engine.grammars.process.step_timings()
        if timer.worker_ms:
            row[label]["worker_ms_per_step"] = _spread(timer.worker_ms)
            row[label]["join_ms_per_step"] = _spread(timer.join_ms)
            row[label]["accept_ms_per_step"] = round(1e3 * accept.total_s / len(timer.worker_ms), 3)
        print(f"   {label}: {json.dumps({k: v for k, v in row[label].items() if k != 'profile_per_step'})}", flush=True)
        del engine
        free_memory()
    row["apply_ms_per_step"] = round(apply_cost_ms(vocab, args.max_num_seqs), 4)
    row["plain_ratio"] = round(row["mixed"]["plain_tokens_per_s"] / row["all_plain"]["plain_tokens_per_s"], 4)
    row["plain_per_request_ratio"] = round(
        row["mixed"]["plain_tokens_per_s_per_request"] / row["all_plain"]["plain_tokens_per_s_per_request"], 4
    )
    # the issue's own reading: every request json_schema against none
    row["json_ratio"] = round(row["all_json"]["output_tokens_per_s"] / row["all_plain"]["output_tokens_per_s"], 4)
    row["step_ms"] = {k: round(1e3 * row[k]["seconds"] / row[k]["steps"], 3) for k, _ in runs}
    del ours
    free_memory()
    return row


def _spread(times_ms: list[float]) -> dict[str, float]:
    ordered = sorted(times_ms)
    return {
        "mean": round(statistics.mean(ordered), 3),
        "median": round(statistics.median(ordered), 3),
        "p90": round(ordered[int(0.9 * len(ordered))], 3),
        "steps": len(ordered),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | all-plain tok/s | mixed: plain tok/s (x2 for 50%) | plain per-request ratio | "
        "all-json tok/s | all-json / all-plain | step ms plain / mixed / all-json | worker ms/step (accept), mixed | "
        "engine-thread join ms/step (mean), mixed | apply ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        worker = r["mixed"].get("worker_ms_per_step", {}).get("median", float("nan"))
        join = r["mixed"].get("join_ms_per_step", {}).get("mean", float("nan"))
        accept = r["mixed"].get("accept_ms_per_step", float("nan"))
        lines.append(
            f"| {r['model']} | {r['all_plain']['plain_tokens_per_s']:.0f} | "
            f"{r['mixed']['plain_tokens_per_s']:.0f} | {r['plain_per_request_ratio']:.3f} "
            f"({'ok' if r['plain_per_request_ratio'] >= TARGET_RATIO else 'MISS'} vs {TARGET_RATIO}) | "
            f"{r['all_json']['output_tokens_per_s']:.0f} | {r['json_ratio']:.3f} "
            f"({'ok' if r['json_ratio'] >= TARGET_RATIO else 'MISS'}) | "
            f"{r['step_ms']['all_plain']:.2f} / {r['step_ms']['mixed']:.2f} / {r['step_ms']['all_json']:.2f} | "
            f"{worker:.3f} ({accept:.3f}) | "
            f"{join:.3f} | "
            f"{r['apply_ms_per_step']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def skip_grammar_work() -> None:
    """--skip-grammar-work: the worker takes the step's tokens but never advances a matcher nor fills a mask."""

    def no_ends(rows: Any, token_ids: list[int], num_rows: int) -> list[bool]:
        return [False] * num_rows

    def no_masks(worker: MaskWorker, accept: Any, fill: Any, slot: int) -> tuple[Any, int, int]:
        return (accept() if accept is not None else None), slot, 0

    engine_module._grammar_ends_of = no_ends
    MaskWorker._run = no_masks  # type: ignore[method-assign,assignment]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,llama-3.1-8b")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory with the SmolLM2 tokenizer")
    parser.add_argument("--quick", action="store_true", help="64 requests x 128 prompt x 32 output tokens")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--repeat-plain", action="store_true", help="a second all-plain run: run-to-run noise")
    parser.add_argument(
        "--fill-threads",
        type=int,
        help="xgrammar's mask-filling threads, on the worker thread or in the grammar process (default: the engine's)",
    )
    parser.add_argument(
        "--switch-interval-ms", type=float, help="the GIL switch interval the mask worker sets (5: Python's default)"
    )
    parser.add_argument(
        "--xgrammar-accept",
        action="store_true",
        help="advance the matchers with xgrammar's own batched accept, which hands the GIL back 2N + 2 times "
        "(the engine's, matcher_calls.batch_accept, keeps it): the A/B of 2026-11-29",
    )
    parser.add_argument(
        "--accept-releases-gil",
        action="store_true",
        help="the engine's accept releases the GIL through its C++ (matcher_calls.HOLD_GIL off)",
    )
    parser.add_argument(
        "--grammar-processes",
        type=int,
        default=0,
        help="the matchers in this many grammar processes of the engine (0, the default: on its worker thread)",
    )
    parser.add_argument(
        "--skip-grammar-work",
        action="store_true",
        help="a lower bound: grammar rows whose matchers are never advanced nor their masks filled (what the "
        "engine's own per-row handling costs; on the worker thread, --grammar-processes 0)",
    )
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.skip_grammar_work:
        args.grammar_processes = 0
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 64, 128, 32
    return args


def main() -> None:
    args = parse_args()
    if args.fill_threads is not None:
        mask_worker.FILL_THREADS = grammar_process.FILL_THREADS = args.fill_threads
    if args.switch_interval_ms is not None:
        mask_worker.SWITCH_INTERVAL_S = args.switch_interval_ms / 1e3
    if args.xgrammar_accept:
        matcher_calls.binding_accept = lambda: None  # type: ignore[assignment]  # (before anything calls it)
    matcher_calls.HOLD_GIL = not args.accept_releases_gil
    if args.skip_grammar_work:
        skip_grammar_work()
    device = torch.cuda.get_device_name()
    report: dict[str, Any] = {
        "environment": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": device,
            "torch": torch.__version__,
            "command": "python -m bench.structured_throughput " + " ".join(sys.argv[1:]),
        },
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "max_num_seqs": args.max_num_seqs,
            "schema": SCHEMA,
        },
        "grammar_worker": {
            "fill_threads": mask_worker.FILL_THREADS,
            "process_fill_threads": grammar_process.FILL_THREADS,
            "switch_interval_s": mask_worker.SWITCH_INTERVAL_S,
            "accept": "xgrammar" if args.xgrammar_accept else "matcher_calls",
            "accept_holds_gil": matcher_calls.HOLD_GIL and not args.xgrammar_accept,
            "grammar_processes": args.grammar_processes,
            "skip_grammar_work": args.skip_grammar_work,
        },
        "models": [],
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "structured_throughput_" + device.split()[-1].lower() + ("_quick" if args.quick else "") + args.tag
    for name in args.models.split(","):
        report["models"].append(bench_model(name, args))
        (args.out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2))  # partial results survive
    text = table(report["models"])
    (args.out_dir / f"{stem}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
