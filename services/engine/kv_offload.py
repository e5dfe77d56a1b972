"""The host-memory KV tier (`--kv-offload-gb`): prefix blocks evicted from the device cache are kept in host
memory and copied back on a later prefix hit instead of being recomputed.

`HostKVTier` is the bookkeeping (which prefix hash sits in which host slot, LRU), kept by the KV cache manager;
`HostKVCaches` is the memory, kept by the model runner, which applies each step's `KVTransfers` before the
step's forward pass, in stream order:

    saves  device block -> host slot   a cached block the scheduler is about to reuse (evicted from the device)
    loads  host slot -> device block   a prefix hit in host memory, into a block just taken for it

Saves run before loads, and both before the forward pass, so a block evicted and reused in the same step is
read before it is overwritten. A slot with a load pending is never the one a save takes (`_pinned`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class KVTransfers:
    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class HostKVTier:
    def __init__(self, num_slots: int) -> None:
        assert num_slots > 0
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._orphans: list[int] = []  # pinned slots whose hash was forgotten: free once their load is handed out
        self._pinned: set[int] = set()  # slots read by a load not yet handed to the runner
        self._pending = KVTransfers()
        self.records_events = False  # set by whoever publishes KV events (else nobody would drain them)
        self.stored: list[bytes] = []  # KV events: hashes that entered / left the host tier
        self.removed: list[bytes] = []

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    @property
    def num_cached(self) -> int:
        return len(self._slots)

    def save(self, block_id: int, block_hash: bytes) -> None:
        """The device block holding `block_hash` is about to be reused: copy it out, unless the host has it."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot is being loaded from this step: this block is simply dropped
        self._slots[block_hash] = slot
        self._pending.saves.append((block_id, slot))
        if self.records_events:
            self.stored.append(block_hash)

    def load(self, block_hash: bytes, block_id: int) -> None:
        """Copy the host copy of `block_hash` into device block `block_id` before the next forward pass."""
        slot = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._pinned.add(slot)
        self._pending.loads.append((slot, block_id))

    def drain(self) -> KVTransfers:
        """This step's copies, for the runner; the slots they read may be reused from now on."""
        pending, self._pending = self._pending, KVTransfers()
        self._pinned.clear()
        self._free.extend(self._orphans)
        self._orphans.clear()
        return pending

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        stored = [h for h in dict.fromkeys(self.stored) if h in self._slots]
        removed = [h for h in dict.fromkeys(self.removed) if h not in self._slots]
        self.stored, self.removed = [], []
        return stored, removed

    def cached_hashes(self) -> list[bytes]:
        return list(self._slots)

    def clear(self) -> None:
        """Forget every block (the weights changed); copies already queued still run, harmlessly."""
        if self.records_events:
            self.removed.extend(self._slots)
        for slot in self._slots.values():
            (self._orphans if slot in self._pinned else self._free).append(slot)
        self._slots.clear()

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for victim, slot in self._slots.items():  # least recently used first
            if slot not in self._pinned:
                del self._slots[victim]
                if self.records_events:
                    self.removed.append(victim)
                # a copy into it still pending is void: two in one step would race in the scatter
                self._pending.saves = [(block, s) for block, s in self._pending.saves if s != slot]
                return slot
        return None


class HostKVCaches:
    """The host tier's memory: one pinned (on CUDA) row of bytes per slot, holding a block's K and V of every
    layer, and the copies of `KVTransfers`. Copies are raw bytes, so any cache dtype works.

    Every copy is a device-side operation in stream order; the host never reads or writes the bytes itself,
    so nothing waits for the GPU. A save gathers the evicted blocks of every layer into a device staging
    buffer, then copies each block's row into its slot (device to pinned host, asynchronously). A load
    copies the slots' rows into a staging buffer and scatters them into the blocks. Stream order puts a
    block's save before the step that overwrites it, and a slot's save before a later load of it."""

    def __init__(self, num_slots: int, device_caches: list[torch.Tensor]) -> None:
        self.num_slots = num_slots
        # per layer: the cache as [2, num_blocks, bytes per block half] and that half's offset in a slot's row
        self._layers = [cache.view(torch.uint8).view(2, cache.shape[1], -1) for cache in device_caches]
        self._offsets = [0]
        for layer in self._layers:
            self._offsets.append(self._offsets[-1] + 2 * layer.shape[2])
        pin = device_caches[0].is_cuda
        self.slots = torch.empty((num_slots, self._offsets[-1]), dtype=torch.uint8, pin_memory=pin)

    def apply(self, transfers: KVTransfers) -> None:
        """This step's copies, into and out of the device caches given at construction."""
        if transfers.saves:
            self._save(transfers.saves)
        if transfers.loads:
            self._load(transfers.loads)

    def _save(self, saves: list[tuple[int, int]]) -> None:
        for chunk in _chunks(saves):
            blocks = torch.tensor([block for block, _ in chunk], device=self._layers[0].device)
            staging = torch.empty((len(chunk), self._offsets[-1]), dtype=torch.uint8, device=blocks.device)
            for layer, start, stop in zip(self._layers, self._offsets, self._offsets[1:]):
                staging[:, start:stop].view(len(chunk), 2, -1).copy_(layer.index_select(1, blocks).transpose(0, 1))
            for first, slot, count in _runs([slot for _, slot in chunk]):
                self.slots[slot : slot + count].copy_(staging[first : first + count], non_blocking=True)

    def _load(self, loads: list[tuple[int, int]]) -> None:
        for chunk in _chunks(loads):
            blocks = torch.tensor([block for _, block in chunk], device=self._layers[0].device)
            staging = torch.empty((len(chunk), self._offsets[-1]), dtype=torch.uint8, device=blocks.device)
            for first, slot, count in _runs([slot for slot, _ in chunk]):
                staging[first : first + count].copy_(self.slots[slot : slot + count], non_blocking=True)
            for layer, start, stop in zip(self._layers, self._offsets, self._offsets[1:]):
                layer[:, blocks] = staging[:, start:stop].view(len(chunk), 2, -1).transpose(0, 1)


_CHUNK_BLOCKS = 64  # blocks per staging buffer: bounds its device memory (an 8B model's block is 2 MiB)


def _chunks(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    return [pairs[i : i + _CHUNK_BLOCKS] for i in range(0, len(pairs), _CHUNK_BLOCKS)]


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index of the first, its slot, count) for each run of consecutive slots: one copy per run."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((i, slot, 1))
    return runs


def num_host_slots(gigabytes: float, device_caches: list[torch.Tensor]) -> int:
    """Host blocks that fit `gigabytes` (a block: every layer's K and V of `block_size` tokens)."""
    bytes_per_block = sum(cache[:, 0].numel() * cache.element_size() for cache in device_caches)
    return int(gigabytes * (1 << 30)) // bytes_per_block
