"""Speculative decoding: batch-1 ITL with and without n-gram drafts, and speedup vs acceptance (oracle drafts).

Two parts, each against plain decoding (the default engine: on CUDA async scheduling and decode graphs):
  ngram   the real SmolLM2 weights (or --model) asked to repeat a passage: batch-1 inter-token latency with
          and without `{"method": "ngram", ...}`, with the acceptance figures (drafts, accepted, per position)
  oracle  random weights of a real shape (--shape), made decisive (make_decisive: no near-tie for rounding to
          flip): a bench-only proposer replays the target's own greedy
          continuation, each drafted token replaced by a wrong one with probability --corruption; decode
          tok/s per sequence vs plain at k = 2, 4, 6 and batch 1, 8, 32

    python -m bench.spec_decode                                   # GPU: SmolLM2 ngram + 8B-shape oracle
    python -m bench.spec_decode --quick                           # CPU: tiny settings, checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import gc
import itertools
import json
import platform
import pstats
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.throughput import SHAPES
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.models import load_model
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.spec_decode import SpeculativeDecoding
from pagedserve.services.engine.spec_decode.ngram import NgramProposer
from pagedserve.shared.config import Config
from pagedserve.shared.model_source import resolve_model_dir

RESULTS_DIR = Path(__file__).parent / "results"
TINY_SHAPE = dict(
    vocab_size=512,
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
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil and a soft "
    "cloth. He polished the great lens until it shone, trimmed the wick, and struck a single match. As the "
    "flame caught, the beam swept out across the grey water, touching the rocks, the fishing boats returning "
    "to harbour, and the distant line where the sea met the sky. Sailors had trusted that light for over a "
    "hundred years, and the keeper never once let it fail, not in the winter storms when the waves broke "
    "against the tower, nor on the calm summer nights when the sea lay flat and silver under the moon."
)
_ids = itertools.count()


class OracleProposer:
    """Bench only: drafts the target's known greedy continuation, each token wrong with probability `corruption`."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], corruption: float, vocab_size: int) -> None:
        self.answers, self.corruption, self.vocab_size = answers, corruption, vocab_size
        self.rng = random.Random(0)

    def propose(self, requests: Sequence[Request], max_num_tokens: Sequence[int]) -> list[list[int]]:
        drafts = []
        for request, k in zip(requests, max_num_tokens):
            done = request.num_output_tokens
            answer = self.answers[tuple(request.prompt_token_ids)][done : done + k]
            drafts.append([self._maybe_wrong(t) for t in answer])
        return drafts

    def _maybe_wrong(self, token_id: int) -> int:
        if self.rng.random() >= self.corruption:
            return token_id
        return (token_id + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_decode(engine: Engine, prompts: list[list[int]], max_tokens: int, until_eos: bool = False) -> dict[str, Any]:
    """Run the prompts together (greedy; fixed length, or up to max_tokens ending at EOS); decode time counts
    from the step that gave every sequence its first token, per token after the first of the longest."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not until_eos)
    ids = [f"bench-{next(_ids)}" for _ in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    first_done = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if first_done is None and all(tokens.values()):
            sync(engine.device)
            first_done = time.perf_counter()
    sync(engine.device)
    end = time.perf_counter()
    assert first_done is not None
    decode_tokens = max(len(t) for t in tokens.values()) - 1  # per sequence, after the first
    seconds = end - first_done
    return {
        "tokens": [tokens[i] for i in ids],
        "itl_ms": 1e3 * seconds / decode_tokens,
        "tok_s_per_seq": decode_tokens / seconds,
        "tok_s": len(prompts) * decode_tokens / seconds,
    }


def engine_for(model: CausalLM, model_dir: Path, args: argparse.Namespace, spec: dict | None, k: int = 4) -> Engine:
    settings: dict[str, Any] = {
        "model": str(model_dir),
        "device": args.device,
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_seqs": max(args.batches),
        "profile_steps": True,  # host phases and GPU time per step kind (CUDA events read with the results)
    }
    if spec is not None:
        settings["speculative_config"] = json.dumps({**spec, "num_speculative_tokens": k})
    return Engine(Config.of(**settings), model=model)


def acceptance(engine: Engine) -> dict[str, Any]:
    stats = engine.stats()
    drafts = stats.num_spec_drafts
    return {
        "num_drafts": drafts,
        "num_draft_tokens": stats.num_spec_draft_tokens,
        "num_accepted_tokens": stats.num_spec_accepted_tokens,
        "acceptance_rate": stats.num_spec_accepted_tokens / max(1, stats.num_spec_draft_tokens),
        "mean_accepted_length": 1 + stats.num_spec_accepted_tokens / max(1, drafts),
        "accepted_per_position": list(stats.num_spec_accepted_tokens_per_pos),
    }


def release(*engines: Engine) -> None:
    for engine in engines:
        engine.shutdown()
    del engines
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_ngram(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": f"Repeat this passage exactly, word for word:\n\n{PASSAGE}"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt: list[int] = list(tokenizer(str(text), add_special_tokens=False)["input_ids"])
    model = load_model(model_dir, args.dtype, args.device, show_progress=False)
    spec = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    plain = engine_for(model, model_dir, args, None)
    fast = engine_for(model, model_dir, args, spec, args.ngram_k)
    timed_decode(plain, [prompt], 8)  # warm both (first-call costs), then measure
    timed_decode(fast, [prompt], 8)
    fast.speculative = SpeculativeDecoding(NgramProposer(2, 4), args.ngram_k, fast.max_model_len)  # fresh counters
    plain.profile.reset()
    fast.profile.reset()
    base = timed_decode(plain, [prompt], args.ngram_tokens, until_eos=True)
    with _profiled(args.cprofile):
        spec_run = timed_decode(fast, [prompt], args.ngram_tokens, until_eos=True)
    plain_ids, spec_ids = base["tokens"][0], spec_run["tokens"][0]
    row = {
        "part": "ngram",
        "model": str(args.model or "SmolLM2-135M-Instruct"),
        "k": args.ngram_k,
        "batch": 1,
        "prompt_tokens": len(prompt),
        "dtype": args.dtype,
        "output_tokens": len(plain_ids),
        "spec_output_tokens": len(spec_ids),
        "plain_itl_ms": base["itl_ms"],
        "spec_itl_ms": spec_run["itl_ms"],
        "speedup": base["itl_ms"] / spec_run["itl_ms"],
        "same_output": plain_ids == spec_ids,
        "first_difference": next((i for i, (a, b) in enumerate(zip(plain_ids, spec_ids)) if a != b), None),
        "output_text": tokenizer.decode(spec_ids[:80]),
        **acceptance(fast),
        "plain_profile_per_step": plain.profile.summary(),
        "spec_profile_per_step": fast.profile.summary(),
    }
    release(plain, fast)
    return row


@contextlib.contextmanager
def _profiled(path: str | None) -> Iterator[None]:
    """cProfile the block into `path` (40 functions by own time, 60 by cumulative), or nothing without a path."""
    if path is None:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        with open(path, "w") as out:
            stats = pstats.Stats(profiler, stream=out)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(60)


def shape_model(args: argparse.Namespace) -> tuple[CausalLM, Path]:
    from transformers import GenerationConfig, LlamaConfig

    shape = TINY_SHAPE if args.shape == "tiny" else SHAPES[args.shape]
    config = LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    model_dir = Path(tempfile.mkdtemp(prefix=f"pagedserve-spec-{args.shape}-"))
    config.save_pretrained(model_dir)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(model_dir)
    model = load_model(model_dir, args.dtype, args.device, show_progress=False, random_weights_seed=0)
    if args.decisive_weights:
        make_decisive(model)
    return model, model_dir


def make_decisive(model: CausalLM) -> None:
    """Random weights whose greedy choice no rounding can flip. Each decoder layer's output projections (o_proj,
    down_proj) are zeroed, so the residual stream stays the token's embedding exactly while every layer still
    does all its work (a GEMM costs the same whatever the values), and the LM head is made those embeddings, so
    the argmax is the current token by ~sqrt(hidden) / 4.5 standard deviations: greedy repeats the last prompt
    token. With plain random weights the 8B shape's logits are near-ties in bf16: rounding differences between
    the decode step's kernels and the verify step's (a k + 1-token query), or fused vs unfused layers, change
    the greedy token within 5-16 steps (1-8% of the oracle's drafts accepted on an H100; fp32 accepts all)."""
    params = dict(model.named_parameters())
    embed, head = params["model.embed_tokens.weight"], params.get("lm_head.weight")  # no head: tied
    with torch.no_grad():
        for name, param in params.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        if head is not None:
            head.copy_(embed)


def run_oracle(args: argparse.Namespace) -> list[dict[str, Any]]:
    model, model_dir = shape_model(args)
    vocab_size = model.spec.vocab_size
    rng = random.Random(0)
    rows = []
    plain = engine_for(model, model_dir, args, None)
    fast = engine_for(model, model_dir, args, {"method": "ngram"}, max(args.ks))  # its proposer is replaced
    assert fast.speculative is not None
    for batch in args.batches:
        prompts = [[rng.randrange(100, vocab_size) for _ in range(args.prompt_len)] for _ in range(batch)]
        timed_decode(plain, prompts, 4)  # warm this batch size
        base = timed_decode(plain, prompts, args.oracle_tokens)
        answers = {tuple(p): t for p, t in zip(prompts, base["tokens"])}
        for k, corruption in itertools.product(args.ks, args.corruption):
            fast.speculative = SpeculativeDecoding(
                OracleProposer(answers, corruption, vocab_size), k, fast.max_model_len
            )
            run = timed_decode(fast, prompts, args.oracle_tokens)
            rows.append(
                {
                    "part": "oracle",
                    "shape": args.shape,
                    "batch": batch,
                    "k": k,
                    "corruption": corruption,
                    "plain_tok_s_per_seq": base["tok_s_per_seq"],
                    "spec_tok_s_per_seq": run["tok_s_per_seq"],
                    "speedup": run["tok_s_per_seq"] / base["tok_s_per_seq"],
                    "same_output": run["tokens"] == base["tokens"],
                    **acceptance(fast),
                }
            )
            print(_line(rows[-1]), flush=True)
    release(plain, fast)
    return rows


def _line(row: dict[str, Any]) -> str:
    where = f"{row['part']:<6} batch {row['batch']:>3} k {row['k']}"
    if row["part"] == "oracle":
        where += f" corrupt {row['corruption']:.2f}"
        speeds = f"plain {row['plain_tok_s_per_seq']:8.1f} spec {row['spec_tok_s_per_seq']:8.1f} tok/s/seq"
    else:
        speeds = f"plain ITL {row['plain_itl_ms']:7.2f} ms spec ITL {row['spec_itl_ms']:7.2f} ms"
    return (
        f"{where:<36} {speeds}  x{row['speedup']:.2f}  accept {row['acceptance_rate']:.2f}"
        f"  mean len {row['mean_accepted_length']:.2f}  same output {row['same_output']}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench spec_decode", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shape, few tokens")
    parser.add_argument("--parts", default="ngram,oracle", help="which parts to run (comma-separated)")
    parser.add_argument("--model", default=None, help="ngram part's checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=["tiny", *SHAPES], help="oracle part's shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--ks", default="2,4,6", help="oracle: draft lengths")
    parser.add_argument("--batches", default="1,8,32", help="oracle: concurrent sequences")
    parser.add_argument("--corruption", default="0,0.2,0.5", help="oracle: share of drafted tokens made wrong")
    parser.add_argument("--ngram-k", type=int, default=4)
    parser.add_argument("--ngram-tokens", type=int, default=400, help="ngram: output tokens at most (ends at EOS)")
    parser.add_argument(
        "--cprofile", default=None, help="cProfile into this text file: ngram's speculative run, else the oracle part"
    )
    parser.add_argument("--oracle-tokens", type=int, default=128, help="oracle: output tokens per sequence")
    parser.add_argument("--prompt-len", type=int, default=128, help="oracle: prompt tokens")
    parser.add_argument(
        "--decisive-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="oracle: random weights with an unambiguous greedy token (make_decisive); off: plain random weights",
    )
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: what the batch needs")
    parser.add_argument("--out", default=None, help="JSON path (default: bench/results/spec_decode_DEVICE_DATE.json)")
    args = parser.parse_args()
    if args.quick:
        args.shape, args.ks, args.batches, args.corruption = "tiny", "2,4", "1,4", "0,0.5"
        args.ngram_tokens, args.oracle_tokens, args.prompt_len = 24, 16, 32
    args.ks = [int(k) for k in args.ks.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.corruption = [float(c) for c in args.corruption.split(",")]
    if args.num_kv_blocks is None:  # room for the biggest batch of the oracle part, or the ngram prompt
        per_seq = max(args.prompt_len + args.oracle_tokens, 512 + args.ngram_tokens) + max(args.ks) + 16
        args.num_kv_blocks = -(-max(args.batches) * per_seq // 16) + 16
    return args


def main() -> None:
    args = parse_args()
    parts = args.parts.split(",")
    rows = []
    if "ngram" in parts:
        rows.append(run_ngram(args))
        print(_line(rows[-1]), flush=True)
    if "oracle" in parts:
        with _profiled(args.cprofile if "ngram" not in parts else None):
            rows += run_oracle(args)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    result = {
        "benchmark": "spec_decode",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name,
        "args": {k: v for k, v in vars(args).items()},
        "rows": rows,
    }
    print("\n".join(_line(r) for r in rows))
    out = (
        Path(args.out)
        if args.out
        else RESULTS_DIR / f"spec_decode_{args.device.split(':')[0]}_{datetime.date.today()}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
