"""Host (Python) time per engine step at N running decode sequences, on any device (CPU by default).

    python -m bench.host_step [--num-seqs 256] [--steps 64] [--json out.json] [--cprofile out.txt]
    python -m bench.host_step --num-seqs 128 --grammar-fraction 0.5 --async-scheduling   # json_schema rows

A tiny random Llama (2 layers, hidden 64) keeps the forward pass negligible, so what is left is the
per-step host work that a small model pays on the GPU too: schedule, prepare (inputs, metadata),
sample (sampling metadata; on CPU the sampling math itself), update and output processing. Every
sequence has its prompt prefilled before timing starts; the table shows mean ms per decode step.

With --grammar-fraction, that share of the sequences (spread evenly) runs under bench/structured_throughput.py's
json_schema (>= 64 rows, so none finishes while timed); the model then takes the SmolLM2 tokenizer's
vocabulary (49152 ids; --tokenizer, default the SmolLM2 directory the tests use) so xgrammar has real tokens.
Compare with an all-plain run of the same vocabulary: --vocab-size 49152.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.structured_throughput import SCHEMA
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from pagedserve.shared.grammar_spec import GrammarSpec

GRAMMAR_VOCAB = 49152  # the SmolLM2 tokenizer's


def tiny_model_dir(vocab_size: int = 512, tokenizer: Path | None = None) -> Path:
    """A random 2-layer Llama; with `tokenizer`, its tokenizer files are copied in beside it."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
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
    path = Path(tempfile.mkdtemp(prefix="host-step-"))
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if tokenizer is not None and (tokenizer / name).exists():
            shutil.copy(tokenizer / name, path / name)
    return path


def _tokenizer_dir(args: argparse.Namespace) -> Path | None:
    if args.vocab_size != GRAMMAR_VOCAB:
        return None
    if args.tokenizer is not None:
        return Path(args.tokenizer)
    from pagedserve.shared.model_source import resolve_model_dir

    return resolve_model_dir(None)  # the SmolLM2 checkpoint (its tokenizer only)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = _tokenizer_dir(args)
    model_dir = tiny_model_dir(args.vocab_size, tokenizer)
    max_tokens = args.steps * args.repeats + 8
    config = Config.of(
        model=str(model_dir),
        device=args.device,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=max(2048, args.num_seqs * args.prompt_len),
        num_kv_blocks=args.num_seqs * (-(-(args.prompt_len + max_tokens) // 16) + 1),
        profile_steps=True,
        async_scheduling=args.async_scheduling,
    )
    engine = Engine(config)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=max_tokens, ignore_eos=True)
    constrained = replace(params, structured_output=GrammarSpec.json_schema(SCHEMA))
    num_json = round(args.num_seqs * args.grammar_fraction)
    if num_json:  # compile once before timing (cached by schema, as a server would have it)
        engine.grammars.pool.submit(GrammarSpec.json_schema(SCHEMA)).result()
    for i in range(args.num_seqs):
        is_json = i * num_json // args.num_seqs != (i + 1) * num_json // args.num_seqs  # spread evenly
        engine.add_request(
            f"r{i}", [(7 * i + j) % 500 + 3 for j in range(args.prompt_len)], constrained if is_json else params
        )
    while engine.stats().num_running < args.num_seqs:
        engine.step()  # prefill everything
    for _ in range(6):  # (waiting for two "eager" steps never ended on CUDA, where decode steps replay graphs)
        engine.step()  # the first decode steps (a grammar's first masks) are not the steady state
    profiler = cProfile.Profile() if args.cprofile else None
    chunks = []  # the machine may be shared: time several chunks of steps, keep the quietest
    for _ in range(args.repeats):
        engine.profile.reset()
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        for _ in range(args.steps):
            engine.step()
        if profiler:
            profiler.disable()
        seconds = time.perf_counter() - start
        summary = engine.profile.summary()
        chunks.append((_without_forward(summary), seconds, summary))
    _, seconds, summary = min(chunks, key=lambda c: c[0])
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(args.sort).print_stats(args.cprofile_top)
        args.cprofile.write_text(out.getvalue())
    return {
        "num_seqs": args.num_seqs,
        "steps": args.steps,
        "repeats": args.repeats,
        "wall_ms_per_step": round(seconds * 1e3 / args.steps, 3),
        "profile": summary,
        "all_chunks_ms_without_forward": [round(c[0], 3) for c in chunks],
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "grammar_rows": num_json,
        "async_scheduling": engine.is_async,
    }


def _without_forward(summary: dict[str, Any]) -> float:
    """Host ms per step outside the forward pass (the model here is tiny on purpose)."""
    return sum(s["host_total_ms"] - s["host_ms"]["forward"] for s in summary.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per timed chunk")
    parser.add_argument("--repeats", type=int, default=3, help="timed chunks; the quietest is reported")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--grammar-fraction", type=float, default=0.0, help="share of sequences under json_schema")
    parser.add_argument("--vocab-size", type=int, help=f"default 512; {GRAMMAR_VOCAB} with --grammar-fraction")
    parser.add_argument("--tokenizer", type=Path, help=f"tokenizer of a {GRAMMAR_VOCAB}-id vocab (default SmolLM2)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cprofile", type=Path, help="write cProfile's top functions here")
    parser.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    parser.add_argument("--cprofile-top", type=int, default=45, help="functions listed in --cprofile's file")
    args = parser.parse_args()
    if args.vocab_size is None:
        args.vocab_size = GRAMMAR_VOCAB if args.grammar_fraction else 512
    if args.grammar_fraction and args.vocab_size != GRAMMAR_VOCAB:
        parser.error(f"--grammar-fraction needs --vocab-size {GRAMMAR_VOCAB} (the tokenizer's)")
    torch.set_num_threads(1)
    result = run(args)
    for kind, stats in result["profile"].items():
        host = stats["host_ms"]
        print(
            f"{kind}: {stats['steps']} steps, {stats['tokens_per_step']} tokens/step, host ms/step: "
            + ", ".join(f"{k} {v:.3f}" for k, v in host.items())
            + f" | total {stats['host_total_ms']:.3f}, without forward {_without_forward({kind: stats}):.3f}"
        )
    print(f"wall {result['wall_ms_per_step']} ms/step; chunks w/o forward {result['all_chunks_ms_without_forward']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
