"""xgrammar vs llguidance on the SmolLM2 tokenizer: grammar compile time and per-token mask time.

For a few JSON schemas (and a regex), each engine compiles the grammar (cold, no cache), then a
matcher walks a valid output token by token: fill the next-token bitmask, accept the token. The
per-token time is what the engine's step pays per grammar row (on the host, beside the forward).

    python -m bench.grammar_engines            # writes bench/results/grammar_engines.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["id", "tags"],
            },
            "kind": {"enum": ["a", "b", "c"]},
            "score": {"type": "number"},
        },
        "required": ["user", "kind", "score"],
    },
    "array_of_objects": {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "properties": {
                "x": {"type": "number"},
                "y": {"type": "number"},
                "label": {"type": "string", "maxLength": 20},
            },
            "required": ["x", "y", "label"],
        },
    },
    "json_object": {"type": "object"},
}
OUTPUTS = {
    "flat": {"name": "Ada Lovelace", "age": 36},
    "nested": {"user": {"id": 7, "tags": ["math", "engines", "notes"]}, "kind": "b", "score": 3.25},
    "array_of_objects": [{"x": 1.5, "y": -2, "label": "first"}, {"x": 0, "y": 10, "label": "second point"}],
    "json_object": {"anything": [1, 2, {"goes": True}], "here": "yes"},
}


def bench_xgrammar(tokenizer: Any, vocab_size: int, schema: dict[str, Any], tokens: list[int]) -> dict[str, float]:
    import torch
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    if schema == {"type": "object"}:  # json_object: any JSON (the schema form is strict: no properties)
        compiled = compiler.compile_builtin_json_grammar()
    else:
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    compile_ms = (time.perf_counter() - start) * 1e3
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    times = []
    for token in [*tokens, tokenizer.eos_token_id]:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        ok = matcher.accept_token(token)
        times.append((time.perf_counter() - start) * 1e6)
        assert ok, f"xgrammar rejected token {token}"
    logits = torch.zeros(64, vocab_size)
    masks = xgr.allocate_token_bitmask(64, vocab_size)
    start = time.perf_counter()
    for _ in range(20):
        xgr.apply_token_bitmask_inplace(logits, masks)
    apply_us = (time.perf_counter() - start) / 20 * 1e6
    return {
        "compile_ms": compile_ms,
        "mask_us_median": statistics.median(times),
        "mask_us_max": max(times),
        "apply_64_rows_cpu_us": apply_us,
    }


def bench_llguidance(tokenizer: Any, vocab_size: int, schema: dict[str, Any], tokens: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import numpy as np

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)  # compiles lazily; the first masks pay the rest
    err = matcher.get_error()
    compile_ms = (time.perf_counter() - start) * 1e3
    assert not err, err
    bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    times = []
    for token in [*tokens, tokenizer.eos_token_id]:
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        ok = matcher.consume_token(token)
        times.append((time.perf_counter() - start) * 1e6)
        assert ok, f"llguidance rejected token {token}: {matcher.get_error()}"
    return {"compile_ms": compile_ms, "mask_us_median": statistics.median(times), "mask_us_max": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(Path.home() / ".cache/pagedserve/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--out", default="bench/results/grammar_engines.json")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    vocab_size = 49152
    rows = []
    for name, schema in SCHEMAS.items():
        text = json.dumps(OUTPUTS[name], separators=(",", ":"))
        tokens = tokenizer.encode(text, add_special_tokens=False)
        for engine, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            result = fn(tokenizer, vocab_size, schema, tokens)
            rows.append({"schema": name, "engine": engine, "num_tokens": len(tokens) + 1, **result})
    print(f"{'schema':<18}{'engine':<12}{'tokens':>7}{'compile ms':>12}{'mask us p50':>13}{'mask us max':>13}")
    for r in rows:
        print(
            f"{r['schema']:<18}{r['engine']:<12}{r['num_tokens']:>7}{r['compile_ms']:>12.1f}"
            f"{r['mask_us_median']:>13.1f}{r['mask_us_max']:>13.1f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"vocab_size": vocab_size, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
