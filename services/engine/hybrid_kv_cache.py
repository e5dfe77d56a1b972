"""The KV cache of a model with global and sliding-window layers (Gemma 2/3, gpt-oss): one manager per group.

`HybridKVCacheManager` is group 0's manager (a full-attention group: its block tables and prefix-cache keys are
what the scheduler and KV events see) and drives one more manager per other group (kv_cache_groups.py). All of
them take blocks from one shared pool (layer j of every group writes cache tensor j), and key their prefix
blocks apart (a suffix byte per group). Every group holds a table entry for every block of a sequence, so the
tables line up; a sliding group hands back the blocks behind its window as the sequence advances (their
entries stay, never read), so it holds a window of blocks however long the sequence runs.

    allocate      every group takes its blocks, or none does (a sequence is preempted as one)
    prefix hits   the longest prefix every group can serve (vLLM's rule): group 0's cached run, cut to where
                  each sliding group still holds the blocks inside the window before it
    free          every group hands back its blocks

No host tier (kv_offload.py keeps one copy of a prefix block for every layer): the worker keeps one group then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.services.engine.async_steps import KnownTokensKVCacheManager
from pagedserve.services.engine.kv_cache_groups import KVCacheGroup, is_hybrid
from pagedserve.services.engine.request import Request

GroupHit = tuple[int, list[int]]  # (leading blocks skipped as out of the window, cached ids after them)


def _all_tokens_known(request: Request) -> int:
    return len(request.all_token_ids)


class HybridKVCacheManager(KnownTokensKVCacheManager):
    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_known_tokens: Callable[[Request], int] = _all_tokens_known,
    ) -> None:
        assert is_hybrid(groups) and groups[0].window is None
        super().__init__(num_blocks, block_size, enable_prefix_caching, num_known_tokens)
        self.others = [
            KnownTokensKVCacheManager(
                num_blocks,
                block_size,
                enable_prefix_caching,
                num_known_tokens,
                window=group.window,
                pool=self.pool,
                key_suffix=bytes([index]),
            )
            for index, group in enumerate(groups[1:], start=1)
        ]
        self._hits: dict[str, list[GroupHit]] = {}  # seq_id -> each other group's prefix hit, until allocate

    @property
    def frees_out_of_window(self) -> bool:
        return True

    def group_block_tables(self, requests: Sequence[Request]) -> list[list[list[int]]]:
        """Per group after the first, `block_tables` of its own blocks (group 0's are `block_tables`)."""
        return [group.block_tables(requests) for group in self.others]

    def fits_in_place(self, request: Request, num_tokens: int) -> bool:
        return super().fits_in_place(request, num_tokens) and all(
            group.fits_in_place(request, num_tokens) for group in self.others
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix every group can serve: group 0's hit, shortened until each other group
        holds every block it needs right after it (a sliding one: those inside its window)."""
        first_ids, num_hit_tokens = super().get_computed_blocks(request)
        num_blocks = num_hit_tokens // self.block_size
        hits: list[GroupHit] = []
        while num_blocks and len(hits) < len(self.others):  # a shorter hit may fail an earlier group: start over
            end, skipped, ids = self.others[len(hits)].longest_hit(request.block_hashes, num_blocks)
            if end < num_blocks:
                num_blocks, hits = end, []
                continue
            hits.append((skipped, ids))
        if not num_blocks:
            self._hits.pop(request.seq_id, None)
            return [], 0
        self._hits[request.seq_id] = hits
        return first_ids[:num_blocks], num_blocks * self.block_size

    def allocate(
        self, request: Request, num_tokens: int, computed_block_ids: Sequence[int] = (), num_skipped: int = 0
    ) -> list[int] | None:
        """Blocks in every group for the first `num_tokens` tokens, or None (nothing changes) if the pool is short."""
        hits = self._hits.pop(request.seq_id, None) if computed_block_ids else None
        if hits is None:
            hits = [(0, [])] * len(self.others)
        needed = self.blocks_needed(request, num_tokens, computed_block_ids) + sum(
            group.blocks_needed(request, num_tokens, ids, skipped) for group, (skipped, ids) in zip(self.others, hits)
        )
        if needed > self.pool.num_free_blocks:
            return None
        for group, (skipped, ids) in zip(self.others, hits):
            group.allocate(request, num_tokens, ids, skipped)  # room checked above
        return super().allocate(request, num_tokens, computed_block_ids)

    def release_out_of_window(self, request: Request) -> None:
        for group in self.others:
            group.release_out_of_window(request)

    def num_held_group_blocks(self, request: Request) -> list[int]:
        """Blocks the sequence holds now in each group (group 0 first)."""
        return [self.num_held_blocks(request), *(group.num_held_blocks(request) for group in self.others)]

    def publish_known(self, request: Request) -> None:
        super().publish_known(request)
        for group in self.others:
            group.publish_known(request)

    def free(self, request: Request) -> None:
        self._hits.pop(request.seq_id, None)
        for group in self.others:
            group.free(request)
        super().free(request)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self._hits.clear()
        for group in self.others:
            group.reset_prefix_cache()

    def count_holders(self, holders: list[int]) -> None:
        super().count_holders(holders)
        for group in self.others:
            group.count_holders(holders)

    def check_invariants(self) -> None:
        super().check_invariants()  # every group's holders against the shared pool's ref counts
        lengths = {seq_id: len(ids) for seq_id, ids in self._blocks.items()}
        for group in self.others:
            assert {seq_id: len(ids) for seq_id, ids in group._blocks.items()} == lengths, "tables out of line"
