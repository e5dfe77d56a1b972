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
    """The host tier's memory: per layer `[2, num_slots, block_size, num_kv_heads, head_dim]` like the device
    caches (pinned on CUDA), and the copies of `KVTransfers`. Copies are raw bytes, so any cache dtype works.

    Saves are asynchronous: the evicted blocks are gathered on the device and copied into pinned staging
    memory in stream order (after the step that filled them, before the one that reuses them); they are
    scattered into their slots when the next transfers come, by then long done. A load first finishes any
    such scatter, so it may read a slot saved in the same step (then it waits for the stream)."""

    def __init__(self, num_slots: int, device_caches: list[torch.Tensor]) -> None:
        self.num_slots = num_slots
        self._pin = device_caches[0].is_cuda
        self.caches = [
            torch.empty((2, num_slots, *cache.shape[2:]), dtype=cache.dtype, pin_memory=self._pin)
            for cache in device_caches
        ]
        self._staged: tuple[list[torch.Tensor], torch.Tensor, torch.cuda.Event | None] | None = None

    def apply(self, transfers: KVTransfers, device_caches: list[torch.Tensor]) -> None:
        if transfers.saves:
            self._save(transfers.saves, device_caches)
        if transfers.loads:
            self._finish_saves()
            self._load(transfers.loads, device_caches)

    def _save(self, saves: list[tuple[int, int]], device_caches: list[torch.Tensor]) -> None:
        self._finish_saves()
        device = device_caches[0].device
        blocks = torch.tensor([block for block, _ in saves], device=device)
        staged = []
        for cache in device_caches:
            gathered = _bytes(cache).index_select(1, blocks)  # [2, n, ...] on the device, in stream order
            stage = torch.empty(gathered.shape, dtype=torch.uint8, pin_memory=self._pin)
            stage.copy_(gathered, non_blocking=True)
            staged.append(stage)
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._staged = (staged, torch.tensor([slot for _, slot in saves]), event)

    def _finish_saves(self) -> None:
        if self._staged is None:
            return
        staged, slots, event = self._staged
        if event is not None:
            event.synchronize()
        for host, stage in zip(self.caches, staged):
            _bytes(host)[:, slots] = stage
        self._staged = None

    def _load(self, loads: list[tuple[int, int]], device_caches: list[torch.Tensor]) -> None:
        device = device_caches[0].device
        slots = torch.tensor([slot for slot, _ in loads])
        blocks = torch.tensor([block for _, block in loads], device=device)
        for host, cache in zip(self.caches, device_caches):
            _bytes(cache)[:, blocks] = _bytes(host)[:, slots].to(device, non_blocking=True)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """The cache as raw bytes (the last dim widened): indexing and copies then work for fp8 caches too."""
    return cache.view(torch.uint8)


def num_host_slots(gigabytes: float, device_caches: list[torch.Tensor]) -> int:
    """Host blocks that fit `gigabytes` (a block: every layer's K and V of `block_size` tokens)."""
    bytes_per_block = sum(cache[:, 0].numel() * cache.element_size() for cache in device_caches)
    return int(gigabytes * (1 << 30)) // bytes_per_block
