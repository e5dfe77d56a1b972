"""KV cache groups (global layers one, each sliding window another) and the hybrid manager: every group takes
its blocks or none does, sliding groups hand back blocks behind their window, a prefix hit is one every group
can serve, and the sizing gives the sliding groups' bounded pools' memory to the full group."""

from __future__ import annotations

from pagedserve.services.engine.hybrid_kv_cache import HybridKVCacheManager
from pagedserve.services.engine.kv_cache_groups import (
    KVCacheGroup,
    blocks_per_sliding_sequence,
    capacity_line,
    first_group_blocks,
    is_hybrid,
    kv_cache_groups,
    sliding_pool_bound,
    with_block_counts,
)
from pagedserve.services.engine.kv_cache_manager import FILLER_BLOCK, KVCacheManager
from tests.engine.engine_helpers import make_request

BLOCK = 4
WINDOW = 8


def hybrid(num_full: int = 32, num_sliding: int = 32, prefix_caching: bool = True) -> HybridKVCacheManager:
    groups = [KVCacheGroup(None, (1,), num_full), KVCacheGroup(WINDOW, (0,), num_sliding)]
    return HybridKVCacheManager(groups, BLOCK, prefix_caching)


def test_groups_by_layer_kind() -> None:
    gemma3 = [1024, 1024, 1024, 1024, 1024, None] * 2
    groups = kv_cache_groups(gemma3, 12)
    assert [(g.window, g.layers) for g in groups] == [(None, (5, 11)), (1024, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10))]
    assert is_hybrid(groups)
    assert kv_cache_groups([], 4) == [KVCacheGroup(None, (0, 1, 2, 3))]  # Llama: all global
    assert kv_cache_groups([8, 8, 8], 3) == [KVCacheGroup(8, (0, 1, 2))]  # Mistral v0.1: all slide, one group
    assert kv_cache_groups([8, None], 2, hybrid=False) == [KVCacheGroup(None, (0, 1))]  # hybrid manager off
    assert [g.window for g in kv_cache_groups([4, None, 8], 3)] == [None, 4, 8]  # one group per window


def test_sliding_pools_take_their_bound_and_the_rest_goes_to_the_full_group() -> None:
    groups = kv_cache_groups([WINDOW, None, WINDOW, None], 4)
    bound = sliding_pool_bound(WINDOW, BLOCK, max_num_seqs=2, max_num_batched_tokens=16)
    assert bound == 2 * (2 + 3) + 4
    # 1000 blocks' worth per layer: the sliding layers need only `bound`, the full layers get the rest
    num_full = first_group_blocks(4 * 1000, 1, groups, BLOCK, 2, 16)
    assert num_full == (4000 - 2 * bound) // 2
    sized = with_block_counts(groups, num_full, BLOCK, 2, 16)
    assert [g.num_blocks for g in sized] == [num_full, bound]
    assert "with window freeing" in capacity_line(sized, BLOCK, 1)
    # a budget below the bound: an even split (a sliding sequence never holds more than a full one)
    assert first_group_blocks(4 * 10, 1, groups, BLOCK, 2, 16) == 10
    assert [g.num_blocks for g in with_block_counts(groups, 10, BLOCK, 2, 16)] == [10, 10]
    one = kv_cache_groups([], 4)
    assert first_group_blocks(4 * 1000, 1, one, BLOCK, 2, 16) == 1000


def test_every_group_takes_blocks_and_the_sliding_one_frees_behind_its_window() -> None:
    kv = hybrid()
    request = make_request(list(range(30)))
    assert kv.allocate(request, 30) is not None  # 8 blocks in each group
    assert kv.num_held_blocks(request) == 8 and kv.num_held_sliding_blocks(request) == [8]
    request.num_computed_tokens = 30
    kv.release_out_of_window(request)  # the next query at 30 sees keys 23..30: sliding blocks 0-3 go back
    assert kv.num_held_blocks(request) == 8 and kv.num_held_sliding_blocks(request) == [4]
    assert kv.num_free_blocks == 32 - 8 and kv.sliding[0].num_free_blocks == 32 - 4
    [tables] = kv.group_block_tables([request])
    assert len(tables[0]) == len(kv.block_ids(request)) == 8  # tables line up; released entries stay, unread
    kv.check_invariants()
    kv.free(request)
    assert kv.num_free_blocks == 32 and kv.sliding[0].num_free_blocks == 32
    kv.check_invariants()


def test_a_sequence_holds_a_bounded_number_of_sliding_blocks_however_long_it_runs() -> None:
    kv = hybrid(num_full=64, num_sliding=blocks_per_sliding_sequence(WINDOW, BLOCK, 16))
    request = make_request(list(range(16)))
    held = []
    for num_tokens in range(16, 200, 3):  # chunks of 3 tokens after a 16-token prefill
        kv.release_out_of_window(request)
        assert kv.allocate(request, num_tokens) is not None, "the sliding pool is its bound: never short"
        request.num_computed_tokens = num_tokens
        held.append(kv.num_held_sliding_blocks(request)[0])
        kv.check_invariants()
    assert kv.num_held_blocks(request) == 50 and max(held[1:]) <= -(-(WINDOW + 3) // BLOCK) + 3


def test_allocation_is_all_groups_or_none() -> None:
    kv = hybrid(num_full=32, num_sliding=4)
    request = make_request(list(range(30)))
    assert kv.allocate(request, 30) is None  # the sliding pool has 4 of the 8 blocks: nothing taken anywhere
    assert kv.num_free_blocks == 32 and kv.sliding[0].num_free_blocks == 4 and not kv.block_ids(request)
    kv.check_invariants()
    assert kv.allocate(request, 16) is not None
    assert kv.num_free_blocks == 28 and kv.sliding[0].num_free_blocks == 0
    kv.check_invariants()


def test_window_hit_skips_the_blocks_before_the_window() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BLOCK, window=WINDOW)
    first = make_request(list(range(40)))
    kv.allocate(first, 40)  # publishes 10 full blocks
    first.num_computed_tokens = 40
    kv.release_out_of_window(first)
    hashes = first.block_hashes
    # a 9-block prefix: the query at 36 sees keys 29..36, blocks 7-8; the ones before need not be cached
    assert kv.window_hit(hashes, 9) == (9, 7, kv.block_ids(first)[7:9])
    kv.free(first)
    kv.pool.take(16)  # evicts every cached block
    assert kv.window_hit(hashes, 9) == (0, 0, [])


def test_a_prefix_hit_is_one_every_group_can_serve() -> None:
    kv = hybrid()
    prompt = list(range(40))
    first = make_request(prompt)
    kv.allocate(first, 40)
    first.num_computed_tokens = 40
    kv.release_out_of_window(first)  # sliding blocks 0-5 back to the pool, still cached
    second = make_request(prompt)
    hit_ids, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 36 and hit_ids == kv.block_ids(first)[:9]  # at most num_tokens - 1
    assert kv.allocate(second, 40, hit_ids) is not None
    sliding = kv.sliding[0]
    # the sliding group's hit starts at the window: its leading entries are fillers, held as released
    assert sliding.block_ids(second)[:7] == [FILLER_BLOCK] * 7 and sliding.num_held_blocks(second) == 3
    assert sliding.block_ids(second)[7:9] == sliding.block_ids(first)[7:9]
    kv.check_invariants()
    kv.free(first)
    kv.free(second)
    kv.check_invariants()


def test_a_hit_the_sliding_group_evicted_is_cut_to_what_it_still_holds() -> None:
    kv = hybrid(num_full=32, num_sliding=12)
    prompt = list(range(40))
    first = make_request(prompt)
    kv.allocate(first, 40)
    first.num_computed_tokens = 40
    kv.free(first)
    kv.sliding[0].pool.take(12)  # another sequence's sliding blocks evict the cached ones
    second = make_request(prompt)
    assert kv.get_computed_blocks(second) == ([], 0)  # the full group alone could serve 36 tokens
    kv.sliding[0].pool.release(range(12))
    kv.check_invariants()


def test_without_prefix_caching_nothing_hits() -> None:
    kv = hybrid(prefix_caching=False)
    first = make_request(list(range(40)))
    kv.allocate(first, 40)
    assert kv.get_computed_blocks(make_request(list(range(40)))) == ([], 0)
