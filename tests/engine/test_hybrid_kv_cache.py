"""KV cache groups (global layers one, each sliding window another) and the hybrid manager: every group takes
its blocks or none does, sliding groups hand back blocks behind their window, a prefix hit is one every group
can serve, and the sizing gives the sliding groups' bounded pools' memory to the full group."""

from __future__ import annotations

from pagedserve.services.engine.block_pool import KVEventLog
from pagedserve.services.engine.hybrid_kv_cache import HybridKVCacheManager
from pagedserve.services.engine.kv_cache_groups import (
    KVCacheGroup,
    blocks_for_context,
    blocks_per_sliding_sequence,
    capacity_line,
    is_hybrid,
    kv_cache_groups,
    layer_groups,
    layer_slots,
    max_context,
    num_cache_tensors,
)
from pagedserve.services.engine.kv_cache_manager import FILLER_BLOCK, KVCacheManager
from tests.engine.engine_helpers import make_request

BLOCK = 4
WINDOW = 8
GROUPS = [KVCacheGroup(None, (1,)), KVCacheGroup(WINDOW, (0,))]


def hybrid(num_blocks: int = 64, prefix_caching: bool = True) -> HybridKVCacheManager:
    return HybridKVCacheManager(GROUPS, num_blocks, BLOCK, prefix_caching)


def test_groups_by_layer_kind_of_one_size() -> None:
    gemma3 = [1024, 1024, 1024, 1024, 1024, None] * 2
    groups = kv_cache_groups(gemma3, 12)  # 2 global, 10 local: groups of 2 layers
    assert [(g.window, g.layers) for g in groups] == [
        (None, (5, 11)),
        (1024, (0, 1)),
        (1024, (2, 3)),
        (1024, (4, 6)),
        (1024, (7, 8)),
        (1024, (9, 10)),
    ]
    assert is_hybrid(groups) and num_cache_tensors(groups) == 2
    assert layer_slots(groups, 12)[:6] == [0, 1, 0, 1, 0, 0] and layer_groups(groups, 12)[:6] == [1, 1, 2, 2, 3, 0]
    gemma2 = [4096, None] * 3
    assert [g.layers for g in kv_cache_groups(gemma2, 6)] == [(1, 3, 5), (0, 2, 4)]
    assert [g.layers for g in kv_cache_groups([8, None, 8, 8, 8], 5)] == [(1,), (0,), (2,), (3,), (4,)]
    # 3 global, 4 local: groups of 3, the last one short (its blocks leave one tensor unused)
    assert [g.layers for g in kv_cache_groups([8, None, None, 8, 8, None, 8], 7)] == [(1, 2, 5), (0, 3, 4), (6,)]
    # within 25%: one group per kind, of the larger size (the smaller one pads)
    nine_and_eight = kv_cache_groups([8, None] * 8 + [None], 17)
    assert [g.layers for g in nine_and_eight] == [(*range(1, 16, 2), 16), tuple(range(0, 16, 2))]
    assert kv_cache_groups([], 4) == [KVCacheGroup(None, (0, 1, 2, 3))]  # Llama: all global
    assert kv_cache_groups([8, 8, 8], 3) == [KVCacheGroup(8, (0, 1, 2))]  # Mistral v0.1: all slide, one group
    assert kv_cache_groups([8, None], 2, hybrid=False) == [KVCacheGroup(None, (0, 1))]  # hybrid manager off
    assert [g.window for g in kv_cache_groups([4, None, 8], 3)] == [None, 4, 8]  # one kind per window


def test_a_sequence_takes_a_window_of_sliding_blocks_from_the_shared_pool() -> None:
    chunk = 16
    per_sliding = blocks_per_sliding_sequence(WINDOW, BLOCK, chunk)
    assert per_sliding == 6 + 3
    assert blocks_for_context(GROUPS, 400, BLOCK, chunk) == 100 + per_sliding
    assert blocks_for_context(GROUPS, 12, BLOCK, chunk) == 3 + 3  # short: as many sliding blocks as full ones
    assert max_context(GROUPS, 100, BLOCK, chunk) == (100 - per_sliding) * BLOCK
    assert max_context([KVCacheGroup(None, (0, 1))], 100, BLOCK, chunk) == 400
    line = capacity_line(GROUPS, 100, BLOCK, chunk)
    assert f"fits {(100 - per_sliding) * BLOCK} tokens with window freeing, 200 without" in line


def test_every_group_takes_blocks_and_the_sliding_one_frees_behind_its_window() -> None:
    kv = hybrid(num_blocks=32)
    request = make_request(list(range(30)))
    assert kv.allocate(request, 30) is not None  # 8 blocks in each group, from the one pool
    assert kv.num_held_group_blocks(request) == [8, 8] and kv.num_free_blocks == 32 - 16
    [tables] = kv.group_block_tables([request])
    assert not set(tables[0]) & set(kv.block_ids(request))  # layer j of each group shares a tensor: never a block
    request.num_computed_tokens = 30
    kv.release_out_of_window(request)  # the next query at 30 sees keys 23..30: sliding blocks 0-3 go back
    assert kv.num_held_group_blocks(request) == [8, 4] and kv.num_free_blocks == 32 - 12
    assert len(kv.group_block_tables([request])[0][0]) == len(kv.block_ids(request)) == 8  # released stay, unread
    kv.check_invariants()
    kv.free(request)
    assert kv.num_free_blocks == 32
    kv.check_invariants()


def test_a_sequence_holds_a_bounded_number_of_sliding_blocks_however_long_it_runs() -> None:
    kv = hybrid(num_blocks=50 + blocks_per_sliding_sequence(WINDOW, BLOCK, 16))
    request = make_request(list(range(16)))
    held = []
    for num_tokens in range(16, 200, 3):  # chunks of 3 tokens after a 16-token prefill
        kv.release_out_of_window(request)
        assert kv.allocate(request, num_tokens) is not None, "50 full blocks and a window: never short"
        request.num_computed_tokens = num_tokens
        held.append(kv.num_held_group_blocks(request)[1])
        kv.check_invariants()
    assert kv.num_held_blocks(request) == 50 and max(held[1:]) <= -(-(WINDOW + 3) // BLOCK) + 3


def test_allocation_is_all_groups_or_none() -> None:
    kv = hybrid(num_blocks=12)
    request = make_request(list(range(30)))
    assert kv.allocate(request, 30) is None  # 16 blocks over both groups: nothing taken anywhere
    assert kv.num_free_blocks == 12 and not kv.block_ids(request) and not kv.others[0].block_ids(request)
    kv.check_invariants()
    assert kv.allocate(request, 24) is not None
    assert kv.num_free_blocks == 0 and kv.num_held_group_blocks(request) == [6, 6]
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
    assert kv.longest_hit(hashes, 9) == kv.window_hit(hashes, 9)
    kv.free(first)
    kv.pool.take(16)  # evicts every cached block
    assert kv.window_hit(hashes, 9) == (0, 0, [])


def test_a_prefix_hit_is_one_every_group_can_serve() -> None:
    kv = hybrid()
    prompt = list(range(40))
    first = make_request(prompt)
    kv.allocate(first, 40)
    first.num_computed_tokens = 40
    kv.release_out_of_window(first)  # sliding blocks 0-6 back to the pool, still cached
    second = make_request(prompt)
    hit_ids, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 36 and hit_ids == kv.block_ids(first)[:9]  # at most num_tokens - 1
    assert kv.allocate(second, 40, hit_ids) is not None
    sliding = kv.others[0]
    # the sliding group's hit starts at the window: its leading entries are fillers, held as released
    assert sliding.block_ids(second)[:7] == [FILLER_BLOCK] * 7 and sliding.num_held_blocks(second) == 3
    assert sliding.block_ids(second)[7:9] == sliding.block_ids(first)[7:9]
    kv.check_invariants()
    kv.free(first)
    kv.free(second)
    kv.check_invariants()


def test_a_hit_the_sliding_group_lost_is_cut_to_what_it_still_holds() -> None:
    kv = hybrid()
    prompt = list(range(40))
    first = make_request(prompt)
    kv.allocate(first, 40)
    first.num_computed_tokens = 40
    sliding_ids = kv.others[0].block_ids(first)
    kv.free(first)
    for block_id in sliding_ids[4:8]:  # blocks 4-7 of the sliding group evicted (their keys forgotten)
        kv.pool._evict(block_id)
    # a hit of 9 blocks needs sliding blocks 7-8, one of 8 blocks needs 5-7, ...: only 4 blocks remain servable
    second = make_request(prompt)
    hit_ids, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 4 * BLOCK and len(hit_ids) == 4
    assert kv.allocate(second, 40, hit_ids) is not None
    # the query at 16 sees keys 9..16: sliding blocks 2-3 are hits, 0-1 fillers
    assert kv.others[0].block_ids(second)[:4] == [FILLER_BLOCK, FILLER_BLOCK, *sliding_ids[2:4]]
    kv.check_invariants()


def test_groups_cache_prefixes_apart_and_only_group_0_reports_them() -> None:
    kv = hybrid()
    kv.pool.event_log = KVEventLog()
    first = make_request(list(range(16)))
    kv.allocate(first, 16)
    stored, removed, _ = kv.pool.drain_events()
    assert stored == first.block_hashes and not removed  # the router sees each prefix once
    assert kv.pool.num_cached_blocks == 8 and kv.pool.cached_hashes() == first.block_hashes


def test_without_prefix_caching_nothing_hits() -> None:
    kv = hybrid(prefix_caching=False)
    first = make_request(list(range(40)))
    kv.allocate(first, 40)
    assert kv.get_computed_blocks(make_request(list(range(40)))) == ([], 0)
