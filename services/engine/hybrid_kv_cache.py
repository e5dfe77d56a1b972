"""The KV cache of a model with global and sliding-window layers (Gemma 2/3, gpt-oss): one manager per group.

`HybridKVCacheManager` is the full group's manager (its pool, block tables and prefix cache are what the
scheduler, the metrics and KV events see) and drives one more manager per sliding group
(kv_cache_groups.py). Every group holds a table entry for every block of a sequence, so the tables line up;
a sliding group hands back the blocks behind its window as the sequence advances (their entries stay,
never read), so it holds a window of blocks however long the sequence runs.

    allocate      every group takes its blocks, or none does (a sequence is preempted as one)
    prefix hits   the longest prefix every group can serve (vLLM's rule): the full group's cached run, cut to
                  where each sliding group still holds the blocks inside the window before it
    free          every group hands back its blocks

No host tier (kv_offload.py keeps one copy per prefix block, of every layer): the worker keeps one group then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedserve.services.engine.async_steps import KnownTokensKVCacheManager
from pagedserve.services.engine.kv_cache_groups import KVCacheGroup, is_hybrid
from pagedserve.services.engine.request import Request

SlidingHit = tuple[int, list[int]]  # (leading blocks skipped as out of the window, cached ids after them)


def _all_tokens_known(request: Request) -> int:
    return len(request.all_token_ids)


class HybridKVCacheManager(KnownTokensKVCacheManager):
    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        block_size: int,
        enable_prefix_caching: bool = True,
        num_known_tokens: Callable[[Request], int] = _all_tokens_known,
    ) -> None:
        assert is_hybrid(groups) and groups[0].window is None and all(g.window for g in groups[1:])
        super().__init__(groups[0].num_blocks, block_size, enable_prefix_caching, num_known_tokens)
        self.sliding = [
            KnownTokensKVCacheManager(
                g.num_blocks, block_size, enable_prefix_caching, num_known_tokens, window=g.window
            )
            for g in groups[1:]
        ]
        self._sliding_hits: dict[str, list[SlidingHit]] = {}  # seq_id -> each sliding group's hit, until allocate

    @property
    def frees_out_of_window(self) -> bool:
        return True

    def group_block_tables(self, requests: Sequence[Request]) -> list[list[list[int]]]:
        """Per sliding group, `block_tables` of its own blocks (the full group's are `block_tables`)."""
        return [group.block_tables(requests) for group in self.sliding]

    def fits_in_place(self, request: Request, num_tokens: int) -> bool:
        return super().fits_in_place(request, num_tokens) and all(
            group.fits_in_place(request, num_tokens) for group in self.sliding
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix every group can serve: the full group's hit, shortened until each
        sliding group holds every block its window needs right after it."""
        full_ids, num_hit_tokens = super().get_computed_blocks(request)
        num_blocks = num_hit_tokens // self.block_size
        hits: list[SlidingHit] = []
        while num_blocks and len(hits) < len(self.sliding):  # a shorter hit may fail another group: start over
            end, skipped, ids = self.sliding[len(hits)].window_hit(request.block_hashes, num_blocks)
            if end < num_blocks:
                num_blocks, hits = end, []
                continue
            hits.append((skipped, ids))
        if not num_blocks:
            self._sliding_hits.pop(request.seq_id, None)
            return [], 0
        self._sliding_hits[request.seq_id] = hits
        return full_ids[:num_blocks], num_blocks * self.block_size

    def allocate(
        self, request: Request, num_tokens: int, computed_block_ids: Sequence[int] = (), num_skipped: int = 0
    ) -> list[int] | None:
        """Blocks in every group for the first `num_tokens` tokens, or None (nothing changes) if one is short."""
        hits = self._sliding_hits.pop(request.seq_id, None) if computed_block_ids else None
        if hits is None:
            hits = [(0, [])] * len(self.sliding)
        if self.blocks_short(request, num_tokens, computed_block_ids) > 0 or any(
            group.blocks_short(request, num_tokens, ids, skipped) > 0
            for group, (skipped, ids) in zip(self.sliding, hits)
        ):
            return None
        for group, (skipped, ids) in zip(self.sliding, hits):
            group.allocate(request, num_tokens, ids, skipped)  # room checked above
        return super().allocate(request, num_tokens, computed_block_ids)

    def release_out_of_window(self, request: Request) -> None:
        for group in self.sliding:
            group.release_out_of_window(request)

    def num_held_sliding_blocks(self, request: Request) -> list[int]:
        """Blocks the sequence holds now in each sliding group."""
        return [group.num_held_blocks(request) for group in self.sliding]

    def publish_known(self, request: Request) -> None:
        super().publish_known(request)
        for group in self.sliding:
            group.publish_known(request)

    def free(self, request: Request) -> None:
        self._sliding_hits.pop(request.seq_id, None)
        for group in self.sliding:
            group.free(request)
        super().free(request)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self._sliding_hits.clear()
        for group in self.sliding:
            group.reset_prefix_cache()

    def check_invariants(self) -> None:
        super().check_invariants()
        lengths = {seq_id: len(ids) for seq_id, ids in self._blocks.items()}
        for group in self.sliding:
            group.check_invariants()
            assert {seq_id: len(ids) for seq_id, ids in group._blocks.items()} == lengths, "tables out of line"
