"""The prefix router: its block names are the engine's (one definition), it sends a prompt to the replica
holding its prefix, and falls back to the shared stream where that would not pay."""

from __future__ import annotations

import time

from pagedserve.services.engine.block_pool import KVEventLog
from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.tokenizer.prefix_router import PrefixIndex, PrefixRouter
from pagedserve.shared import kv_blocks
from pagedserve.shared.protocol import EngineHeartbeat, KVEvents
from tests.engine.engine_helpers import make_request

BLOCK = 4
PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens
# The routers below take any hit by its share of the prompt (min_hit_tokens=0): these prompts are tiny.


def beat(
    engine_id: str, *, used: int = 0, waiting: int = 0, time: float = 0.0, block_size: int = BLOCK
) -> EngineHeartbeat:
    return EngineHeartbeat(
        engine_id,
        "m",
        4096,
        num_waiting=waiting,
        num_free_blocks=1000,
        num_total_blocks=1000,
        time=time,
        block_size=block_size,
    )


def holding(engine_id: str, token_ids: list[int], salt: str | None = None) -> KVEvents:
    ids = [kv_blocks.wire_id(h) for h in kv_blocks.block_hashes(token_ids, BLOCK, salt)]
    return KVEvents(engine_id, BLOCK, ids)


def test_the_router_names_blocks_as_the_engine_caches_them() -> None:
    cache = KVCacheManager(num_blocks=16, block_size=BLOCK)
    cache.pool.event_log = KVEventLog()
    for salt in (None, "tenant-a"):
        request = make_request(PROMPT, SamplingParams(cache_salt=salt, max_tokens=4))
        assert cache.allocate(request, len(PROMPT)) is not None
        stored, removed, reset = cache.pool.drain_events()
        assert [kv_blocks.wire_id(h) for h in stored] == holding("e", PROMPT, salt).stored
        assert removed == [] and not reset
        cache.free(request)


def test_the_pool_reports_the_net_change_of_its_cache() -> None:
    cache = KVCacheManager(num_blocks=4, block_size=BLOCK)
    cache.pool.event_log = KVEventLog()
    first = make_request(PROMPT[:8])
    cache.allocate(first, 8)
    cache.free(first)
    second = make_request(list(range(500, 516)))
    cache.allocate(second, 16)  # takes all 4 blocks: the first request's 2 cached blocks are evicted
    stored, removed, _ = cache.pool.drain_events()
    assert set(stored) == set(kv_blocks.block_hashes(list(range(500, 516)), BLOCK))
    assert set(removed) == set(kv_blocks.block_hashes(PROMPT[:8], BLOCK))  # stored, then evicted: gone now
    cache.free(second)
    cache.reset_prefix_cache()
    assert cache.pool.drain_events() == ([], [], True)
    assert cache.pool.drain_events() == ([], [], False)


def test_index_applies_events_and_snapshots() -> None:
    index = PrefixIndex()
    index.apply(holding("a", PROMPT))
    assert index.overlap("a", holding("x", PROMPT).stored) == 4
    index.apply(KVEvents("a", BLOCK, [], removed=holding("x", PROMPT[:8]).stored[1:2]))
    assert index.overlap("a", holding("x", PROMPT).stored) == 1  # a later block is useless without block 2
    index.apply(KVEvents("a", BLOCK, holding("x", PROMPT[:4]).stored, snapshot=True))
    assert index.num_blocks("a") == 1
    index.drop("a")
    assert index.overlap("a", holding("x", PROMPT).stored) == 0


def test_host_tier_blocks_extend_a_device_hit_and_weigh_half() -> None:
    """a: 1 block on the device + 3 in its host tier (score 2.5); b: 2 on the device (score 2). a wins, with an
    overlap of 4; once b holds 3 on the device (score 3), b does. Events and snapshots keep the host set."""
    blocks = holding("x", PROMPT).stored
    index = PrefixIndex()
    index.apply(KVEvents("a", BLOCK, blocks[:1], host_stored=blocks[1:]))
    assert (index.overlap("a", blocks), index.host_overlap("a", blocks, 1)) == (1, 3)
    index.apply(KVEvents("a", BLOCK, host_removed=blocks[2:3]))
    assert index.host_overlap("a", blocks, 1) == 1  # a later block is useless without block 3
    index.apply(KVEvents("a", BLOCK, blocks[:1], snapshot=True, host_stored=blocks[1:]))
    assert index.host_overlap("a", blocks, 1) == 3
    router = PrefixRouter(min_hit_tokens=0)
    router.index = index
    router.index.apply(holding("b", PROMPT[:8]))
    decision = router.route(PROMPT, None, [beat("a"), beat("b")])
    assert (decision.engine_id, decision.overlap_blocks) == ("a", 4)
    router.index.apply(holding("b", PROMPT[:12]))
    assert router.route(PROMPT, None, [beat("a"), beat("b")]).engine_id == "b"
    index.drop("a")
    assert index.host_overlap("a", blocks, 0) == 0


def test_a_prompt_goes_to_the_replica_holding_its_prefix() -> None:
    router = PrefixRouter(min_hit_tokens=0)
    router.index.apply(holding("b", PROMPT[:12]))
    decision = router.route(PROMPT, None, [beat("a"), beat("b")])
    assert (decision.engine_id, decision.reason, decision.overlap_blocks, decision.prompt_blocks) == (
        "b",
        "prefix",
        3,
        4,
    )
    # another tenant's salt roots another chain: no overlap, so any replica may pull it
    assert router.route(PROMPT, "other", [beat("a"), beat("b")]).engine_id is None


def test_no_useful_overlap_one_replica_or_a_draining_owner_leave_it_to_the_shared_stream() -> None:
    router = PrefixRouter(min_hit_tokens=0)
    assert router.route(PROMPT, None, [beat("a"), beat("b")]).reason == "no_overlap"
    router.index.apply(holding("b", PROMPT[:4]))  # a quarter of the prompt, and short: not worth it
    assert router.route(PROMPT, None, [beat("a"), beat("b")]).reason == "no_overlap"
    router.index.apply(holding("b", PROMPT))
    assert router.route(PROMPT, None, [beat("b")]).reason == "single_engine"
    draining = beat("b")
    draining.is_draining = True
    assert router.route(PROMPT, None, [beat("a"), draining, beat("c")]).reason == "no_overlap"


def test_imbalance_and_a_queue_stop_the_prefix_from_counting() -> None:
    router = PrefixRouter(min_hit_tokens=0, max_queued=2, max_imbalance=3)
    router.index.apply(holding("b", PROMPT))
    assert router.route(PROMPT, None, [beat("a"), beat("b", waiting=2)]).reason == "overflow"
    # requests routed since the owner's last report count as its load: a burst spreads past the imbalance
    engines = [beat("a"), beat("b", time=1.0)]
    reasons = [router.route(PROMPT, None, engines).reason for _ in range(5)]
    assert reasons == ["prefix"] * 4 + ["load"]
    # the owner's KV event after its next step says what runs there now: the requests have finished
    router.index.apply(KVEvents("b", BLOCK, time=time.time() + 1, num_running=0))
    assert router.route(PROMPT, None, engines).reason == "prefix"
    # a report newer than the heartbeat is the one that counts
    router.index.apply(KVEvents("b", BLOCK, time=time.time() + 2, num_running=9))
    assert router.route(PROMPT, None, engines).reason == "load"
    # equal prefixes: the less loaded replica
    router.index.apply(holding("a", PROMPT))
    assert router.route(PROMPT, None, engines).engine_id == "a"


def test_a_gone_replica_is_forgotten() -> None:
    router = PrefixRouter(min_hit_tokens=0)
    router.index.apply(holding("b", PROMPT))
    router.index.apply(holding("c", PROMPT))  # not seen live yet: kept
    router.forget_gone({"a", "b"})
    router.forget_gone({"a"})
    assert router.index.engines() == ["c"]


def test_a_prompt_cache_key_keeps_a_conversation_on_one_replica_until_a_prefix_says_otherwise() -> None:
    router = PrefixRouter(min_hit_tokens=0, max_queued=2)
    engines = [beat("a"), beat("b"), beat("c")]
    first = router.route(PROMPT, None, engines, cache_key="user-1")
    assert first.reason == "cache_key" and first.engine_id is not None
    # the key's replica again, though another is now less loaded (the first request counts on it)
    assert router.route(list(range(7)), None, engines, cache_key="user-1").engine_id == first.engine_id
    other = router.route(PROMPT, None, engines, cache_key="user-2")
    assert other.reason == "cache_key" and other.engine_id != first.engine_id  # the least loaded one
    assert router.route(PROMPT, None, engines).reason == "no_overlap"  # no key: the shared stream
    # a useful prefix elsewhere wins, and the key follows it
    holder = next(e for e in "abc" if e != first.engine_id)
    router.index.apply(holding(holder, PROMPT))
    assert router.route(PROMPT, None, engines, cache_key="user-1").engine_id == holder
    assert router.route(list(range(9)), None, engines, cache_key="user-1").engine_id == holder
    # the key's replica with no room: the shared stream
    full = [beat(e, waiting=2 if e == holder else 0) for e in "abc"]
    assert router.route(list(range(9)), None, full, cache_key="user-1").reason == "overflow"


def test_a_short_shared_prefix_is_no_reason_to_route() -> None:
    """Half of a two-block prompt is cached (a short chat's system prompt): too short to be worth a replica's
    queue. The same share of a long prompt is."""
    router = PrefixRouter(min_hit_tokens=4 * BLOCK)
    short = list(range(200, 208))  # 2 blocks
    router.index.apply(holding("b", short[:4]))
    assert router.route(short, None, [beat("a"), beat("b")]).reason == "no_overlap"
    long = list(range(300, 332))  # 8 blocks, 4 of them cached
    router.index.apply(holding("b", long[:16]))
    assert router.route(long, None, [beat("a"), beat("b")]).reason == "prefix"


def test_an_adapter_request_goes_to_a_replica_holding_the_adapter() -> None:
    router = PrefixRouter(min_hit_tokens=0)
    holder = beat("e2")
    holder.lora_resident = ["sql"]
    engines = [beat("e1"), holder]
    router.index.apply(holding("e1", PROMPT))  # e1 holds the prompt's prefix, but of the base model
    decision = router.route(PROMPT, None, engines, lora_name="sql")
    assert (decision.engine_id, decision.reason, decision.overlap_blocks) == ("e2", "adapter", 0)
    assert router.route(PROMPT, None, engines).engine_id == "e1"  # the base model's request: the prefix
    # the adapter's own blocks are named apart from the base model's, as the engine caches them
    request = make_request(PROMPT)
    request.lora_name = "sql"
    cache = KVCacheManager(num_blocks=16, block_size=BLOCK)
    cache.pool.event_log = KVEventLog()
    assert cache.allocate(request, len(PROMPT)) is not None
    stored = [kv_blocks.wire_id(h) for h in cache.pool.drain_events()[0]]
    assert stored == [kv_blocks.wire_id(h) for h in kv_blocks.block_hashes(PROMPT, BLOCK, None, "sql")]
    assert set(stored).isdisjoint(holding("e1", PROMPT).stored)
    router.index.apply(KVEvents("e2", BLOCK, stored))
    assert router.route(PROMPT, None, engines, lora_name="sql").reason == "prefix"
