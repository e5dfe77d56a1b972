"""KV cache manager: unit cases plus hypothesis state machines over random operation sequences."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.services.engine.block_pool import BlockPool
from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.request import Request
from tests.engine.engine_helpers import make_request

BLOCK_SIZE = 4


def test_allocate_returns_none_without_room_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    a, b = make_request(list(range(10))), make_request(list(range(20, 30)))
    assert kv.allocate(a, 10) is not None  # 3 blocks
    assert kv.allocate(b, 1) is None
    assert kv.block_ids(b) == [] and kv.num_free_blocks == 0
    kv.free(a)
    kv.free(a)  # idempotent
    assert kv.num_free_blocks == 3
    kv.check_invariants()


def test_reserved_draft_slots_are_held_but_never_published() -> None:
    """EAGLE-3's chained drafts write K/V past the last token: blocks held for them, not offered to the cache."""
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request(list(range(8)))
    assert not kv.reserve_slots(a, 12)  # a sequence with no blocks yet reserves nothing
    kv.allocate(a, 7)  # 2 blocks
    assert kv.reserve_slots(a, 12) and len(kv.block_ids(a)) == 3 and kv.num_free_blocks == 1
    assert kv.reserve_slots(a, 9)  # already held
    assert not kv.reserve_slots(a, 24) and len(kv.block_ids(a)) == 3  # too few free: nothing taken
    assert kv.get_computed_blocks(make_request([*range(8), 99, 99, 99, 99, 5]))[1] == 4  # the 2nd block: unfilled
    kv.allocate(a, 8)  # the step that computes the last token publishes the 2nd block, not the reserved 3rd
    assert kv.get_computed_blocks(make_request([*range(8), 99, 99, 99, 99, 5]))[1] == 8
    kv.free(a)
    assert kv.num_free_blocks == 4
    kv.check_invariants()


def test_full_prompt_hit_still_computes_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(8))  # exactly 2 full blocks
    first = make_request(prompt)
    kv.allocate(first, 8)
    hits, num_hit_tokens = kv.get_computed_blocks(make_request(prompt))
    assert num_hit_tokens == 4 and hits == kv.block_ids(first)[:1]  # the last block is recomputed
    hits, num_hit_tokens = kv.get_computed_blocks(make_request([*prompt, 99]))
    assert num_hit_tokens == 8 and hits == kv.block_ids(first)


def test_freed_cached_blocks_are_reused_and_evicted_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    old, new = make_request([1, 1, 1, 1, 5]), make_request([2, 2, 2, 2, 5])
    kv.allocate(old, 5)
    kv.free(old)
    kv.allocate(new, 5)
    kv.free(new)
    assert kv.pool.num_cached_blocks == 2 and kv.num_free_blocks == 4
    # Two fresh blocks come from the uncached ones; a third must evict the older cached prefix.
    filler = make_request([7] * 12)
    kv.allocate(filler, 12)
    assert kv.get_computed_blocks(make_request([1, 1, 1, 1, 5]))[1] == 0
    assert kv.get_computed_blocks(make_request([2, 2, 2, 2, 5]))[1] == 4
    kv.check_invariants()


def test_revived_cached_block_counts_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    first = make_request([1, 2, 3, 4, 5])
    kv.allocate(first, 5)
    kv.free(first)
    second = make_request([1, 2, 3, 4, 6, 7, 8, 9, 10])
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 4
    assert kv.allocate(second, 9, hits) is None  # 1 revived + 2 new > 2 free
    assert kv.allocate(second, 8, hits) is not None  # 1 revived + 1 new
    assert kv.block_ids(second)[0] == hits[0]
    kv.check_invariants()


def test_identical_blocks_with_different_prefixes_do_not_hit() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    kv.allocate(make_request([1, 2, 3, 4, 9, 9, 9, 9, 0]), 9)
    hits, num_hit_tokens = kv.get_computed_blocks(make_request([5, 6, 7, 8, 9, 9, 9, 9, 0]))
    assert hits == [] and num_hit_tokens == 0


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    kv.allocate(make_request(list(range(9))), 9)
    assert kv.get_computed_blocks(make_request(list(range(9)))) == ([], 0)
    assert kv.pool.num_cached_blocks == 0


def test_block_pool_refuses_double_release() -> None:
    pool = BlockPool(2)
    (block,) = pool.take(1) or []
    pool.release([block])
    try:
        pool.release([block])
    except AssertionError:
        return
    raise AssertionError("a second release of a free block went unnoticed")


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions, chunked prefills, decodes, preemptions and frees over a small pool.

    A shadow records what each block holds: the full token prefix up to the block's end, as the
    model would have written it. A cache hit must return blocks whose shadow equals the new
    request's prefix, which is exactly "cached blocks are reused only for identical prefixes"."""

    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE)
        self.running: list[Request] = []
        self.preempted: list[Request] = []
        self.shadow: dict[int, tuple[int, ...]] = {}  # block id -> the prefix it holds

    def _compute(self, request: Request, num_tokens: int) -> None:
        """What the forward pass does: fill the K/V of positions [num_computed, num_tokens)."""
        block_ids = self.kv.block_ids(request)
        for index in range(request.num_computed_tokens // BLOCK_SIZE, -(-num_tokens // BLOCK_SIZE)):
            end = min((index + 1) * BLOCK_SIZE, num_tokens)
            self.shadow[block_ids[index]] = tuple(request.all_token_ids[:end])
        request.num_computed_tokens = num_tokens

    def _admit(self, request: Request, chunk: int) -> None:
        hits, num_hit_tokens = self.kv.get_computed_blocks(request)
        assert num_hit_tokens < request.num_tokens
        for index, block_id in enumerate(hits):
            assert self.shadow[block_id] == tuple(request.all_token_ids[: (index + 1) * BLOCK_SIZE])
        request.num_computed_tokens = num_hit_tokens
        num_tokens = min(request.num_tokens, num_hit_tokens + chunk)
        if self.kv.allocate(request, num_tokens, hits) is None:
            assert self.kv.block_ids(request) == []
            request.num_computed_tokens = 0
            self.preempted.append(request)
            return
        self._compute(request, num_tokens)
        self.running.append(request)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=24), chunk=st.integers(1, 24))
    def add(self, prompt: list[int], chunk: int) -> None:
        self._admit(make_request(prompt), chunk)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), chunk=st.integers(1, 24))
    def readmit(self, data: st.DataObject, chunk: int) -> None:
        request = self.preempted.pop(data.draw(st.integers(0, len(self.preempted) - 1)))
        self._admit(request, chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 8), token=st.integers(0, 2))
    def advance(self, data: st.DataObject, chunk: int, token: int) -> None:
        """Prefill the next chunk, or decode: append a sampled token and compute it."""
        request = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        if request.num_computed_tokens == request.num_tokens:
            request.all_token_ids.append(token)
        num_tokens = min(request.num_tokens, request.num_computed_tokens + chunk)
        if self.kv.allocate(request, num_tokens) is None:
            self.kv.free(request)  # preempted: recomputed from scratch (or the cache) later
            request.num_computed_tokens = 0
            self.running.remove(request)
            self.preempted.append(request)
            return
        self._compute(request, num_tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.kv.free(request)
        self.kv.free(request)  # idempotent

    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()  # free + used == total, ref counts >= 0 and == holders
        used = {b for r in self.running for b in self.kv.block_ids(r)}
        assert self.kv.pool.num_used_blocks == len(used)
        for request in self.running:
            assert len(self.kv.block_ids(request)) * BLOCK_SIZE >= request.num_computed_tokens

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for request in self.running:
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.num_blocks


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVCacheMachine = KVCacheMachine.TestCase
