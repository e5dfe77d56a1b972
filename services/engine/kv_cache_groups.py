"""KV cache groups: which layers share block tables, and which cache tensor each layer writes (vLLM's hybrid KV
cache manager, simplified).

Layers that attend the same way share a group: the global (full-attention) layers, and the sliding-window
layers of each window. A kind with more layers than the smallest kind is cut into several groups of that size,
so every group has (about) the same number of layers. All groups draw blocks from ONE pool, and layer j of every
group writes cache tensor j: a block id then means the same bytes whichever group holds it, and the split
between the groups follows the load (short sequences hold as many sliding blocks as full ones, long ones few):

    Gemma 3 12B (40 local, 8 global)   group 0  full         layers 5, 11, ..., 47   } 8 cache tensors of
                                       groups 1-5  window 1024  8 local layers each  } the pool's blocks

A sliding group frees the blocks that fell out of its window (kv_cache_manager.py), so a sequence holds at most
`blocks_per_sliding_sequence` blocks in it however long it runs. A model with one kind of layer has one group
(Llama: no window; Mistral v0.1: every layer slides), one tensor per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    window: int | None  # the sliding window of its layers; None: full attention
    layers: tuple[int, ...]


def kv_cache_groups(layer_windows: Sequence[int | None], num_layers: int, hybrid: bool = True) -> list[KVCacheGroup]:
    """The groups of a model with these per-layer windows (empty: all global), full-attention groups first.
    Without `hybrid`, or with one kind of layer, one group holds every layer: a window only if every layer
    slides. A kind's layers are cut into groups of the smallest kind's size (vLLM's rule: the largest kind's
    when it is within 25% of the smallest, padding the smaller groups)."""
    windows = list(layer_windows) or [None] * num_layers
    sliding = sorted({w for w in windows if w is not None})
    if not hybrid or not sliding or None not in windows:
        window = max(sliding) if sliding and None not in windows else None
        return [KVCacheGroup(window, tuple(range(num_layers)))]
    kinds = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in [None, *sliding]}
    sizes = [len(layers) for layers in kinds.values()]
    size = max(sizes) if max(sizes) < 1.25 * min(sizes) else min(sizes)
    return [
        KVCacheGroup(kind, tuple(layers[start : start + size]))
        for kind, layers in kinds.items()
        for start in range(0, len(layers), size)
    ]


def is_hybrid(groups: Sequence[KVCacheGroup]) -> bool:
    return len(groups) > 1


def num_cache_tensors(groups: Sequence[KVCacheGroup]) -> int:
    """Cache tensors to allocate: the largest group's layer count (one per layer with one group)."""
    return max(len(g.layers) for g in groups)


def layer_slots(groups: Sequence[KVCacheGroup], num_layers: int) -> list[int]:
    """Each layer's cache tensor: its position within its group."""
    slots = [0] * num_layers
    for group in groups:
        for position, layer in enumerate(group.layers):
            slots[layer] = position
    return slots


def layer_groups(groups: Sequence[KVCacheGroup], num_layers: int) -> list[int]:
    """Each layer's group index (whose block tables its attention reads)."""
    owner = [0] * num_layers
    for index, group in enumerate(groups):
        for layer in group.layers:
            owner[layer] = index
    return owner


def blocks_per_sliding_sequence(window: int, block_size: int, chunk: int) -> int:
    """The most blocks a sequence holds in a sliding group: its window, the chunk being computed (at most
    `chunk` tokens), and the partial blocks at both ends plus the one spare the release keeps."""
    return -(-(window + chunk) // block_size) + 3


def blocks_for_context(groups: Sequence[KVCacheGroup], num_tokens: int, block_size: int, chunk: int) -> int:
    """Pool blocks one sequence of `num_tokens` tokens holds at most, over every group."""
    num_blocks = -(-num_tokens // block_size)
    if not is_hybrid(groups):
        return num_blocks
    return sum(
        num_blocks if g.window is None else min(num_blocks, blocks_per_sliding_sequence(g.window, block_size, chunk))
        for g in groups
    )


def max_context(groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int, chunk: int) -> int:
    """The longest context (a multiple of the block size) one sequence fits in a pool of `num_blocks`."""
    low, high = 0, num_blocks  # in blocks of the sequence; blocks_for_context grows with it
    while low < high:
        mid = (low + high + 1) // 2
        if blocks_for_context(groups, mid * block_size, block_size, chunk) <= num_blocks:
            low = mid
        else:
            high = mid - 1
    return low * block_size


def capacity_line(groups: Sequence[KVCacheGroup], num_blocks: int, block_size: int, chunk: int) -> str:
    """What the pool holds: the groups, and the longest context with window freeing and without (the same
    memory spread over every layer)."""
    num_layers = sum(len(g.layers) for g in groups)
    without = num_blocks * num_cache_tensors(groups) // num_layers * block_size
    kinds = [f"{'full' if g.window is None else f'window {g.window}'} ({len(g.layers)} layers)" for g in groups]
    return (
        f"KV cache: {len(groups)} groups [{', '.join(kinds)}] sharing {num_blocks} blocks of {block_size}; "
        f"one sequence fits {max_context(groups, num_blocks, block_size, chunk)} tokens with window freeing, "
        f"{without} without"
    )
