"""Which KV blocks each sequence owns, and prefix caching over chained hashes of full blocks.

A full block's hash covers its tokens and, through its parent's hash, every token before it, so
equal hashes mean equal prefixes: the definition lives in shared/kv_blocks.py, where the router uses it too.

Blocks are published in the cache when they are *scheduled* to be filled, not after the forward
pass: the model writes every token's K/V of a layer before any query of that layer attends, so a
second sequence admitted in the same step can already share them. This is safe because the
scheduler never frees a sequence between scheduling it and running its step.

When every layer attends within a sliding window (Mistral v0.1, Phi-3-mini: `window`), a running sequence
hands back the blocks wholly before its window (one spare block kept) as it advances, so it holds ~window
tokens of blocks however long it runs. Their ids stay at the front of its block table: attention never reads
them (the window masks or skips those positions), and a block released with a cached prefix stays reusable.
Models that mix global layers in (Gemma, gpt-oss) have one manager per KV cache group, all on one shared pool
(`pool`, prefix keys set apart by `key_suffix`; kv_cache_groups.py, hybrid_kv_cache.py): a sliding group's
manager hands back its blocks the same way, a full group's keeps all. A sliding group's prefix hit skips the
blocks before its window (`window_hit`): `FILLER_BLOCK` stands in for them in the table.

With a host tier (kv_offload.py), a cached block the pool evicts is saved to host memory, and a prefix
lookup goes on in the host tier where the device cache ends: those hits take new device blocks, which the
runner fills from host memory before the step (`drain_transfers`), and are published like computed ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedserve.services.engine.block_pool import BlockPool
from pagedserve.services.engine.kv_offload import HostKVTier, KVTransfers
from pagedserve.services.engine.request import Request
from pagedserve.shared import kv_blocks

FILLER_BLOCK = 0  # table entry of a block out of the window that a hit never had: never read, never written


def root_hash(request: Request) -> bytes:
    """The parent of a request's first block: a `cache_salt` gives its tenant a chain of its own."""
    return kv_blocks.root_hash(request.params.cache_salt, request.lora_name)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host: HostKVTier | None = None,
        window: int | None = None,
        pool: BlockPool | None = None,  # a hybrid KV cache's groups share one (hybrid_kv_cache.py)
        key_suffix: bytes = b"",  # appended to its prefix-cache keys: a shared pool's groups cache apart
    ) -> None:
        self.block_size = block_size
        self._key_suffix = key_suffix
        self.window = window  # every layer's sliding window (the largest), None if any layer is global
        self._num_released: dict[str, int] = {}  # seq_id -> leading blocks handed back (out of the window)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = pool if pool is not None else BlockPool(num_blocks)
        self._blocks: dict[str, list[int]] = {}  # seq_id -> block ids, in position order
        self._num_published: dict[str, int] = {}  # seq_id -> leading blocks offered to the cache
        self.host = host if enable_prefix_caching else None
        self._host_hits: dict[str, list[bytes]] = {}  # seq_id -> hashes found in host memory, until allocate
        if self.host is not None:
            self.pool.on_evict = self.host.save

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def frees_out_of_window(self) -> bool:
        """Whether running sequences hand back blocks behind their window (`release_out_of_window`)."""
        return self.window is not None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request: Request) -> list[int]:
        return self._blocks.get(request.seq_id, [])

    def block_tables(self, requests: Iterable[Request]) -> list[list[int]]:
        """`block_ids` of each request (one step's block tables)."""
        get, no_blocks = self._blocks.get, list[int]()  # shared: the caller only reads them
        return [get(request.seq_id, no_blocks) for request in requests]

    def fits_in_place(self, request: Request, num_tokens: int) -> bool:
        """Whether `allocate(request, num_tokens)` would take no block and publish nothing."""
        seq_id = request.seq_id
        block_ids = self._blocks.get(seq_id)
        if not block_ids or num_tokens > len(block_ids) * self.block_size:
            return False
        return not self.enable_prefix_caching or num_tokens // self.block_size <= self._num_published.get(seq_id, 0)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks holding a prefix of the request's tokens, and how many tokens they cover.

        At most `num_tokens - 1` tokens hit, so that even a full hit computes the last token
        (its logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return [], 0
        self._extend_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_hit_blocks]
        hit_block_ids = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash + self._key_suffix)
            if block_id is None:
                break
            hit_block_ids.append(block_id)
        host_hits = self._host_hits_after(hashes[len(hit_block_ids) :])
        if host_hits:
            self._host_hits[request.seq_id] = host_hits
        else:
            self._host_hits.pop(request.seq_id, None)
        return hit_block_ids, (len(hit_block_ids) + len(host_hits)) * self.block_size

    def num_host_hit_tokens(self, request: Request) -> int:
        """Of the last `get_computed_blocks` hit, the tokens that come from host memory."""
        return len(self._host_hits.get(request.seq_id, ())) * self.block_size

    def drain_transfers(self) -> KVTransfers:
        """The host-tier copies the next step must run first (empty without a host tier)."""
        return self.host.drain() if self.host is not None else KVTransfers()

    def _host_hits_after(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The leading run of `hashes` the host tier holds (none without one)."""
        if self.host is None:
            return []
        hits = []
        for block_hash in hashes:
            if block_hash not in self.host:
                break
            hits.append(block_hash)
        return hits

    def allocate(
        self, request: Request, num_tokens: int, computed_block_ids: Sequence[int] = (), num_skipped: int = 0
    ) -> list[int] | None:
        """Make room for the K/V of the request's first `num_tokens` tokens.

        `computed_block_ids` are prefix-cache hits from `get_computed_blocks` (new sequences only); its host
        hits come next, in the first new blocks. A sliding group's hit starts `num_skipped` blocks in (`window_hit`):
        those are out of the window, held as released. Returns the newly taken block ids, or None when there is
        no room (nothing changes then)."""
        seq_id = request.seq_id
        host_hits = self._host_hits.pop(seq_id, [])
        block_ids = self._blocks.get(seq_id, [])
        if block_ids and not computed_block_ids and self.num_blocks_for(num_tokens) <= len(block_ids):
            # The common decode step: the sequence's last block still has room. Nothing to take.
            if self.enable_prefix_caching:
                self._publish_full_blocks(request, block_ids, num_tokens)
            return []
        assert not computed_block_ids or not block_ids, "cache hits only for a sequence with no blocks"
        if self.blocks_needed(request, num_tokens, computed_block_ids, num_skipped) > self.pool.num_free_blocks:
            return None
        num_new = self.num_blocks_for(num_tokens) - len(block_ids) - num_skipped - len(computed_block_ids)
        self.pool.touch(computed_block_ids)
        new_block_ids = self.pool.take(max(num_new, 0))
        assert new_block_ids is not None  # checked above
        block_ids = [*block_ids, *[FILLER_BLOCK] * num_skipped, *computed_block_ids, *new_block_ids]
        self._blocks[seq_id] = block_ids
        if num_skipped:
            self._num_released[seq_id] = self._num_published[seq_id] = num_skipped
        if host_hits:
            self._load_from_host(host_hits, new_block_ids)
        if self.enable_prefix_caching:
            self._publish_full_blocks(request, block_ids, num_tokens)
        return new_block_ids

    def reserve_slots(self, request: Request, num_slots: int) -> bool:
        """Hold blocks for the sequence's first `num_slots` slots, past its tokens too (an EAGLE-3 head writes
        its drafts' K/V there before the step that verifies them). Published only once they hold tokens, by
        `allocate`. False, with nothing taken, when the pool has too few free blocks."""
        block_ids = self._blocks.get(request.seq_id)
        if not block_ids:
            return False
        num_new = self.num_blocks_for(num_slots) - len(block_ids)
        if num_new <= 0:
            return True
        new_block_ids = self.pool.take(num_new)
        if new_block_ids is None:
            return False
        block_ids.extend(new_block_ids)
        return True

    def blocks_needed(
        self, request: Request, num_tokens: int, computed_block_ids: Sequence[int] = (), num_skipped: int = 0
    ) -> int:
        """Free blocks `allocate` with these arguments takes from the pool (new ones and revived cached ones)."""
        num_held = len(self._blocks.get(request.seq_id, ()))
        num_new = self.num_blocks_for(num_tokens) - num_held - num_skipped - len(computed_block_ids)
        num_revived = sum(1 for b in computed_block_ids if self.pool.is_free(b))
        return max(num_new, 0) + num_revived

    def longest_hit(self, block_hashes: Sequence[bytes], max_blocks: int) -> tuple[int, int, list[int]]:
        """The longest prefix of at most `max_blocks` blocks this group can serve from its cache: (its blocks,
        leading ones skipped as out of the window, the cached ids after them). A full-attention group needs
        every block cached, a sliding one only those inside the window before the next query (`window_hit`)."""
        if self.window is not None:
            return self.window_hit(block_hashes, max_blocks)
        ids = []
        for block_hash in block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash + self._key_suffix)
            if block_id is None:
                break
            ids.append(block_id)
        return len(ids), 0, ids

    def window_hit(self, block_hashes: Sequence[bytes], max_blocks: int) -> tuple[int, int, list[int]]:
        """The longest prefix of at most `max_blocks` blocks this sliding group can serve from its cache: the
        blocks the first query after it still sees must all be cached, those before the window need not be.
        Returns (blocks of the prefix, leading blocks skipped as out of the window, the cached ids after them)."""
        assert self.window is not None
        run: list[int] = []  # cached ids from block `index` on, in reverse
        for index in range(max_blocks - 1, -1, -1):
            block_id = self.pool.lookup(block_hashes[index] + self._key_suffix)
            if block_id is None:
                run = []
                continue
            run.append(block_id)
            end = index + len(run)
            if index <= self.first_block_in_window(end * self.block_size):
                return end, index, run[::-1]
        return 0, 0, []

    def first_block_in_window(self, position: int) -> int:
        """The first block holding a key the query at `position` sees (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, (position - self.window + 1) // self.block_size)

    def _load_from_host(self, host_hits: list[bytes], block_ids: list[int]) -> None:
        """Queue the host copies into the first new blocks, which then hold those prefixes (published now,
        as blocks scheduled to be filled are: the copies run before any query of the step)."""
        assert self.host is not None and len(block_ids) >= len(host_hits)
        for block_hash, block_id in zip(host_hits, block_ids):
            self.host.load(block_hash, block_id)
            self.pool.register(block_id, block_hash)

    def release_out_of_window(self, request: Request) -> None:
        """Hand back the running sequence's blocks that every later query's window starts after: those ending
        at least a block before `num_computed_tokens - window` (the next query's earliest key)."""
        if self.window is None:
            return
        block_ids = self._blocks.get(request.seq_id)
        end = (request.num_computed_tokens - self.window) // self.block_size - 1
        start = self._num_released.get(request.seq_id, 0)
        if not block_ids or end <= start:
            return
        self.pool.release(block_ids[start:end])
        self._num_released[request.seq_id] = end

    def num_held_blocks(self, request: Request) -> int:
        """Blocks the sequence holds now (its table's length less the released ones)."""
        return len(self._blocks.get(request.seq_id, ())) - self._num_released.get(request.seq_id, 0)

    def free(self, request: Request) -> None:
        """Return the sequence's blocks (idempotent). Cached ones stay reusable until evicted."""
        self._host_hits.pop(request.seq_id, None)
        block_ids = self._blocks.pop(request.seq_id, None)
        self._num_published.pop(request.seq_id, None)
        released = self._num_released.pop(request.seq_id, 0)
        if block_ids:
            # The tail first: it is the least likely to be shared, so it should be evicted first.
            self.pool.release(reversed(block_ids[released:]))

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self._num_published.clear()
        self._host_hits.clear()
        if self.host is not None:
            self.host.clear()

    def check_invariants(self) -> None:
        """Assert that every reference on a block belongs to exactly one sequence holding it."""
        self.pool.check_invariants()
        holders = [0] * self.num_blocks
        self.count_holders(holders)
        assert holders == self.pool.ref_counts, "ref counts differ from the sequences holding blocks"

    def count_holders(self, holders: list[int]) -> None:
        """Add one per sequence holding each block (its table less the released entries)."""
        for seq_id, block_ids in self._blocks.items():
            held = block_ids[self._num_released.get(seq_id, 0) :]
            assert len(set(held)) == len(held), "a sequence holds a block twice"
            for block_id in held:
                holders[block_id] += 1

    def _extend_hashes(self, request: Request) -> None:
        """Hash every full block of the request's known tokens not hashed yet."""
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        for block_index in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else root_hash(request)
            hashes.append(kv_blocks.hash_block(parent, tokens[block_index * size : (block_index + 1) * size]))

    def _publish_full_blocks(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        # Slots past the known tokens hold drafts (speculative decoding): not published until they are tokens.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_published.get(request.seq_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(request)
        for block_index in range(start, num_full):
            key = request.block_hashes[block_index] + self._key_suffix
            self.pool.register(block_ids[block_index], key, report=not self._key_suffix)
        self._num_published[request.seq_id] = num_full
