"""KV cache capacity of hybrid (sliding + global) models with and without freeing out-of-window blocks.

    python -m bench kv_capacity [--kv-gib 40] [--block-size 16] [--max-num-batched-tokens 2048]

No GPU, no weights: the attention fields of each model's published config.json (below), the family's own rule
for which layers are local (services/engine/models), and the engine's grouping and sizing (kv_cache_groups.py).
Per model and context length: KV bytes one decoding sequence holds, and how many such sequences a KV budget
holds, when every layer keeps every block (off) and when sliding layers keep only their window (on); and the
longest context one sequence fits (on: its sliding groups also hold a prefill chunk).
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.services.engine.kv_cache_groups import (
    blocks_for_context,
    kv_cache_groups,
    max_context,
    num_cache_tensors,
)
from pagedserve.services.engine.models.gemma import GemmaForCausalLM
from pagedserve.services.engine.models.gpt_oss import GptOssForCausalLM

# config.json attention fields as published (gemma-2-9b; gemma-3-*-it text_config; openai/gpt-oss-*); bf16 KV.
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma-2-9b": dict(
        model_type="gemma2", num_hidden_layers=42, num_key_value_heads=8, head_dim=256, sliding_window=4096
    ),
    "gemma-3-12b": dict(
        model_type="gemma3_text",
        num_hidden_layers=48,
        num_key_value_heads=8,
        head_dim=256,
        sliding_window=1024,
        sliding_window_pattern=6,
    ),
    "gemma-3-27b": dict(
        model_type="gemma3_text",
        num_hidden_layers=62,
        num_key_value_heads=16,
        head_dim=128,
        sliding_window=1024,
        sliding_window_pattern=6,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", num_hidden_layers=24, num_key_value_heads=8, head_dim=64, sliding_window=128
    ),
    "gpt-oss-120b": dict(
        model_type="gpt_oss", num_hidden_layers=36, num_key_value_heads=8, head_dim=64, sliding_window=128
    ),
}
CONTEXTS = (32 * 1024, 128 * 1024)
KV_ITEMSIZE = 2  # bf16


def layer_windows(cfg: dict[str, Any]) -> list[int | None]:
    family = GptOssForCausalLM if cfg["model_type"] == "gpt_oss" else GemmaForCausalLM
    windows: list[int | None] = family.normalize_config(cfg)["layer_windows"]
    return windows


def rows(kv_gib: float, block_size: int, chunk: int) -> list[tuple[str, ...]]:
    budget = int(kv_gib * 2**30)
    table: list[tuple[str, ...]] = []
    for name, cfg in CONFIGS.items():
        windows = layer_windows(cfg)
        num_layers = len(windows)
        layer_block_bytes = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * KV_ITEMSIZE * block_size
        groups = kv_cache_groups(windows, num_layers)
        block_bytes = layer_block_bytes * num_cache_tensors(groups)  # a pool block: one group's layers
        num_blocks = budget // block_bytes  # the shared pool (on)
        num_uniform = budget // (layer_block_bytes * num_layers)  # every layer keeps every block (off)
        num_local = sum(w is not None for w in windows)
        for context in CONTEXTS:
            seq_blocks = -(-context // block_size)
            on_blocks = blocks_for_context(groups, context, block_size, 1)  # decoding: no prefill chunk
            table.append(
                (
                    name,
                    f"{num_local}/{num_layers} local, w={cfg['sliding_window']}",
                    f"{len(groups)}x{num_cache_tensors(groups)}",
                    f"{context // 1024}k",
                    f"{seq_blocks * num_layers * layer_block_bytes / 2**30:.2f}",
                    f"{on_blocks * block_bytes / 2**30:.2f}",
                    f"{seq_blocks * num_layers / (on_blocks * num_cache_tensors(groups)):.1f}x",
                    str(num_uniform // seq_blocks),
                    str(num_blocks // on_blocks),
                    f"{num_uniform * block_size // 1024}k",
                    f"{max_context(groups, num_blocks, block_size, chunk) // 1024}k",
                )
            )
    return table


HEADER = (
    "model",
    "layers",
    "groups",
    "context",
    "GiB/seq off",
    "GiB/seq on",
    "saving",
    "seqs off",
    "seqs on",
    "max ctx off",
    "max ctx on",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--kv-gib", type=float, default=40.0, help="KV cache budget (GiB)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    table = [HEADER, *rows(args.kv_gib, args.block_size, args.max_num_batched_tokens)]
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    print(
        f"KV budget {args.kv_gib:g} GiB (bf16), blocks of {args.block_size}, max_num_batched_tokens "
        f"{args.max_num_batched_tokens}. off: every layer keeps every block; on: sliding layers free blocks out "
        "of their window (groups: KV cache groups x cache tensors; GiB/seq and seqs: decoding sequences of that "
        "context; max ctx: the longest one sequence fits)"
    )
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
