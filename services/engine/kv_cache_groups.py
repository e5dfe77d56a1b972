"""KV cache groups: which layers share block tables, and how many blocks each group's pool gets.

Layers that attend the same way share one group (vLLM's hybrid KV cache manager, simplified): the global
(full-attention) layers one, the sliding-window layers of each window another. Every group has its own
block pool, block tables and per-layer cache tensors of its own block count:

    Gemma 3 (5 local : 1 global)   group 0  window None  layers 5, 11, ...   N blocks (the context's size)
                                   group 1  window 1024  layers 0-4, 6-10 ...  <= a window per sequence

A sliding group frees the blocks that fell out of its window (kv_cache_manager.py), so a sequence holds at
most `blocks_per_sliding_sequence` of them however long it runs; the pool needs no more than
`sliding_pool_bound` blocks, and the memory it saves goes to the full group: longer contexts fit.

A model with one kind of layer has one group (Llama: no window; Mistral v0.1: every layer slides).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    window: int | None  # the sliding window of its layers; None: full attention
    layers: tuple[int, ...]
    num_blocks: int = 0  # blocks in its pool (and in each of its layers' cache tensors); 0 until sized


def kv_cache_groups(layer_windows: Sequence[int | None], num_layers: int, hybrid: bool = True) -> list[KVCacheGroup]:
    """The groups of a model with these per-layer windows (empty: all global), the full group first. Without
    `hybrid` (or with one kind of layer) one group holds every layer: a window only if every layer slides."""
    windows = list(layer_windows) or [None] * num_layers
    sliding = sorted({w for w in windows if w is not None})
    if not hybrid or not sliding or None not in windows:
        window = max(sliding) if sliding and None not in windows else None
        return [KVCacheGroup(window, tuple(range(num_layers)))]
    full = KVCacheGroup(None, tuple(i for i, w in enumerate(windows) if w is None))
    return [full, *(KVCacheGroup(s, tuple(i for i, w in enumerate(windows) if w == s)) for s in sliding)]


def is_hybrid(groups: Sequence[KVCacheGroup]) -> bool:
    return len(groups) > 1


def blocks_per_sliding_sequence(window: int, block_size: int, chunk: int) -> int:
    """The most blocks a sequence holds in a group of this window: its window, the chunk being computed, and
    the partial blocks at both ends plus the one spare the release keeps (kv_cache_manager.py)."""
    return -(-(window + chunk) // block_size) + 3


def sliding_pool_bound(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most blocks all running sequences hold at once in a group of this window: each its window and
    three partial / spare blocks, plus the step's new tokens (shared by all) in blocks."""
    return max_num_seqs * (-(-window // block_size) + 3) + -(-max_num_batched_tokens // block_size)


def with_block_counts(
    groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> list[KVCacheGroup]:
    """Each group's pool size when the first group has `num_blocks`: a sliding group of a hybrid model needs
    no more than its bound (nor more than the full group: a sequence never holds more sliding blocks)."""
    if not is_hybrid(groups):
        return [KVCacheGroup(g.window, g.layers, num_blocks) for g in groups]
    return [
        KVCacheGroup(
            g.window,
            g.layers,
            num_blocks
            if g.window is None
            else min(num_blocks, sliding_pool_bound(g.window, block_size, max_num_seqs, max_num_batched_tokens)),
        )
        for g in groups
    ]


def first_group_blocks(
    budget_bytes: int,
    layer_block_bytes: int,
    groups: Sequence[KVCacheGroup],
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> int:
    """The largest block count of the first (full) group such that every group's pool fits in the budget,
    each layer's block taking `layer_block_bytes`: sliding groups take their bound, the rest goes to the
    full group (with one group, simply the budget over every layer's blocks)."""
    num_layers = sum(len(g.layers) for g in groups)
    uniform = budget_bytes // (layer_block_bytes * num_layers)
    if not is_hybrid(groups):
        return uniform
    counts = with_block_counts(groups, uniform, block_size, max_num_seqs, max_num_batched_tokens)
    capped = [g for g in counts if g.num_blocks < uniform]  # sliding groups whose bound is below the even split
    if not capped:
        return uniform
    left = budget_bytes - sum(g.num_blocks * len(g.layers) * layer_block_bytes for g in capped)
    num_uncapped_layers = num_layers - sum(len(g.layers) for g in capped)
    return max(uniform, left // (layer_block_bytes * num_uncapped_layers))


def capacity_line(groups: Sequence[KVCacheGroup], block_size: int, layer_block_bytes: int) -> str:
    """What the KV cache holds, per group, and the context it would hold without window freeing."""
    total_bytes = sum(g.num_blocks * len(g.layers) for g in groups) * layer_block_bytes
    num_layers = sum(len(g.layers) for g in groups)
    without = total_bytes // (layer_block_bytes * num_layers) * block_size
    parts = [
        f"{'full' if g.window is None else f'window {g.window}'} ({len(g.layers)} layers): {g.num_blocks} blocks"
        for g in groups
    ]
    return (
        f"KV cache groups: {'; '.join(parts)}; {groups[0].num_blocks * block_size} tokens of context "
        f"with window freeing, {without} without"
    )
