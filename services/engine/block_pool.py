"""Physical KV blocks: ref counts, one LRU free queue, and the prefix cache's hash -> block map.

A block is either used (ref_count > 0) or in the free queue (ref_count == 0); a free block may
still hold a cached prefix, which stays reusable until the block is handed out again (evicted):

    free queue:  head [ never-cached / least recently freed ... most recently freed ] tail
                 take() pops the head; release() appends the tail (uncached blocks go to the
                 head, so cached prefixes survive longest)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(slots=True)
class KVEventLog:
    """What the prefix cache gained and lost since the last `BlockPool.drain_events` (the engine's KV
    events: a router keeps an index of which replica holds which prefix). `reset`: all was forgotten."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    reset: bool = False


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id (used or free)
        self.event_log: KVEventLog | None = None  # set by whoever publishes KV events
        self.on_evict: Callable[[int, bytes], None] | None = None  # a cached block is about to be reused
        self._unreported: set[bytes] = set()  # keys no KV event names (a hybrid cache's group-own keys)

    def drain_events(self) -> tuple[list[bytes], list[bytes], bool]:
        """(stored, removed, reset) since the last call, as the state now: a block stored and evicted
        again in between is reported removed, and one evicted and stored again, stored."""
        events = self.event_log
        if events is None or not (events.stored or events.removed or events.reset):
            return [], [], False
        changed = dict.fromkeys([*events.stored, *events.removed])
        stored = [h for h in changed if h in self._cached]
        removed = [h for h in changed if h not in self._cached]
        self.event_log = KVEventLog()
        return stored, removed, events.reset

    def cached_hashes(self) -> list[bytes]:
        """Every prefix block the cache holds now (a KV-event snapshot)."""
        return [h for h in self._cached if h not in self._unreported]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def is_free(self, block_id: int) -> bool:
        return self.ref_counts[block_id] == 0

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on blocks found in the prefix cache (reviving free ones)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def take(self, num_blocks: int) -> list[int] | None:
        """Hand out `num_blocks` blocks (ref count 1), evicting cached contents; None if too few."""
        if num_blocks > len(self._free):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _none = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block; blocks reaching zero join the free queue."""
        for block_id in block_ids:
            assert self.ref_counts[block_id] > 0, f"block {block_id} released more often than taken"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self.block_hashes[block_id] is None:
                    self._free.move_to_end(block_id, last=False)  # nothing worth keeping: reuse first

    def register(self, block_id: int, block_hash: bytes, report: bool = True) -> bool:
        """Publish a used, full block under its hash; False if that prefix already has a block. Without `report`
        no KV event names it (a key only its group of a hybrid cache looks up)."""
        assert self.ref_counts[block_id] > 0
        if block_hash in self._cached or self.block_hashes[block_id] is not None:
            return False
        self._cached[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        if not report:
            self._unreported.add(block_hash)
        elif self.event_log is not None:
            self.event_log.stored.append(block_hash)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after the weights change); used blocks stay used."""
        self._cached.clear()
        self._unreported.clear()
        self.block_hashes = [None] * self.num_blocks
        if self.event_log is not None:
            self.event_log.stored.clear()
            self.event_log.removed.clear()
            self.event_log.reset = True

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (tests and debugging)."""
        assert all(count >= 0 for count in self.ref_counts), "negative ref count"
        assert set(self._free) == {b for b, count in enumerate(self.ref_counts) if count == 0}
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        assert all(self.block_hashes[b] == h for h, b in self._cached.items())
        assert sum(h is not None for h in self.block_hashes) == len(self._cached)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)
            del self._cached[block_hash]
            self.block_hashes[block_id] = None
            if block_hash in self._unreported:
                self._unreported.remove(block_hash)
            elif self.event_log is not None:
                self.event_log.removed.append(block_hash)
