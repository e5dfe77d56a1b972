"""The host-memory KV tier: its LRU bookkeeping, the cache manager's host hits and copies, and an engine whose
evicted prefix comes back from host memory: the same output as computing it again, fewer tokens computed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.kv_offload import HostKVCaches, HostKVTier, KVTransfers, num_host_slots
from pagedserve.services.engine.models import CausalLM
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.shared.config import Config
from tests.engine.engine_helpers import make_request

BLOCK_SIZE = 4


def test_tier_keeps_the_most_recent_and_never_reuses_a_slot_being_loaded() -> None:
    tier = HostKVTier(num_slots=2)
    tier.records_events = True
    tier.save(10, b"a")
    tier.save(11, b"b")
    assert tier.drain().saves == [(10, 0), (11, 1)]
    tier.save(12, b"a")  # already held: only marked recent, no copy
    tier.save(13, b"c")  # full: evicts the least recent, b
    assert b"b" not in tier and b"a" in tier and b"c" in tier
    assert tier.drain().saves == [(13, 1)]
    tier.load(b"a", 20)  # slot 0 is read by this step's load ...
    tier.load(b"c", 21)
    tier.save(14, b"d")  # ... so a save finds no slot to take: d is dropped, a and c stay
    transfers = tier.drain()
    assert transfers.loads == [(0, 20), (1, 21)] and transfers.saves == []
    assert b"d" not in tier and tier.drain_events() == ([b"a", b"c"], [b"b"])


def test_clear_keeps_a_loading_slot_until_its_copy_is_handed_out() -> None:
    tier = HostKVTier(num_slots=2)
    tier.save(1, b"a")
    tier.save(2, b"b")
    tier.drain()
    tier.load(b"a", 9)
    tier.clear()
    tier.save(3, b"c")
    tier.save(4, b"d")  # slot 0 is still being read: d takes c's slot 1, and c's pending copy is void
    assert tier.drain().saves == [(4, 1)] and b"c" not in tier and b"d" in tier
    tier.save(5, b"e")  # slot 0 is back once the load was handed out
    assert tier.drain().saves == [(5, 0)]


def test_manager_saves_evicted_prefixes_and_loads_host_hits_into_new_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, host=HostKVTier(num_slots=8))
    first = make_request(list(range(13)))  # 3 full blocks + 1 token
    kv.allocate(first, 13)
    first_blocks = kv.block_ids(first)
    kv.free(first)
    assert kv.drain_transfers() == KVTransfers()
    other = make_request(list(range(100, 116)))  # takes every block: the three cached ones are evicted
    kv.allocate(other, 16)
    saves = kv.drain_transfers().saves
    assert sorted(block for block, _ in saves) == sorted(first_blocks[:3])
    kv.free(other)

    again = make_request([*range(13), 50])
    hits, num_hit_tokens = kv.get_computed_blocks(again)
    assert num_hit_tokens == 12 and hits == [] and kv.num_host_hit_tokens(again) == 12
    new_blocks = kv.allocate(again, 14, hits)
    assert new_blocks is not None and len(new_blocks) == 4
    slot_of = {block: slot for block, slot in saves}
    loads = kv.drain_transfers().loads
    assert loads == [(slot_of[old], new) for old, new in zip(first_blocks[:3], new_blocks)]
    # the loaded blocks are prefix-cache entries again: a third copy of the prompt hits on the device
    assert kv.get_computed_blocks(make_request([*range(13), 51]))[0] == new_blocks[:3]
    kv.check_invariants()


def test_host_copies_move_raw_blocks_and_saves_land_before_loads() -> None:
    gen = torch.Generator().manual_seed(0)
    caches = [
        torch.randn((2, 6, BLOCK_SIZE, 2, 8), generator=gen).to(dtype) for dtype in (torch.float32, torch.bfloat16)
    ]
    host = HostKVCaches(
        num_host_slots(3 * sum(c[:, 0].numel() * c.element_size() for c in caches) / (1 << 30), caches), caches
    )
    assert host.num_slots == 3
    before = [cache.clone() for cache in caches]
    host.apply(KVTransfers(saves=[(4, 0), (1, 2)]))
    host.apply(KVTransfers(saves=[(5, 1)], loads=[(2, 0), (0, 3)]))  # loads read slots saved just before
    for cache, old in zip(caches, before):
        assert torch.equal(cache[:, 0], old[:, 1]) and torch.equal(cache[:, 3], old[:, 4])
        assert torch.equal(cache[:, 5], old[:, 5]) and torch.equal(cache[:, 2], old[:, 2])
    host.apply(KVTransfers(loads=[(1, 2)]))
    assert all(torch.equal(cache[:, 2], old[:, 5]) for cache, old in zip(caches, before))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _engine(model_dir: Path, model: CausalLM | None, device: str, block_size: int, num_slots: int) -> Engine:
    """12 device blocks, and `num_slots` host blocks (0: no tier); `model` None: the engine loads it (CUDA)."""
    config = Config.of(model=str(model_dir), dtype="float32", device=device, num_kv_blocks=12, block_size=block_size)
    engine = Engine(config, model=model)
    block_bytes = sum(cache[:, 0].numel() * cache.element_size() for cache in engine.runner.kv_caches)
    if num_slots == 0:
        return engine
    config.cache.kv_offload_gb = num_slots * block_bytes / (1 << 30)
    return Engine(config, model=model if model is not None else engine.runner.model)


@pytest.mark.parametrize(
    ("device", "block_size"), [("cpu", BLOCK_SIZE), pytest.param("cuda", 16, marks=CUDA)], ids=["cpu", "cuda"]
)
def test_an_evicted_prefix_comes_back_from_host_memory_with_the_same_output(
    tiny_model: CausalLM, tiny_model_dir: Path, device: str, block_size: int
) -> None:
    """Prompts of 7 full blocks and 2 tokens; each of the two others evicts what is left of the one before."""
    gen = torch.Generator().manual_seed(7)
    prompt, *others = [torch.randint(3, 256, (7 * block_size + 2,), generator=gen).tolist() for _ in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    model = tiny_model if device == "cpu" else None
    with_tier = _engine(tiny_model_dir, model, device, block_size, 64)
    without = _engine(tiny_model_dir, model, device, block_size, 0)
    assert with_tier.kv_cache.host is not None and without.kv_cache.host is None
    results = {}
    for name, engine in (("tier", with_tier), ("none", without)):
        first = engine.generate([prompt], greedy)[0]
        for other in others:
            engine.generate([other], greedy)
        computed = engine.stats().num_computed_tokens
        again = engine.generate([prompt], greedy)[0]
        results[name] = (first, again, engine.stats().num_computed_tokens - computed)
    first, again, computed_tier = results["tier"]
    hit = 7 * block_size
    assert again.token_ids == first.token_ids == results["none"][0].token_ids
    assert again.num_cached_tokens == hit and results["none"][1].num_cached_tokens == 0
    assert computed_tier == results["none"][2] - hit  # the prefix was copied back, not recomputed
    stats = with_tier.stats()
    assert stats.num_prefix_cache_host_hit_tokens == hit and stats.num_host_cached_blocks > 0


@CUDA
def test_host_copies_from_and_to_a_cuda_cache() -> None:
    """Pinned host memory and device staging, all in stream order: a save, then loads in a later step and in the
    same one, with no synchronization between them."""
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn((2, 6, 16, 2, 8), generator=gen).to("cuda", dt) for dt in (torch.float32, torch.bfloat16)]
    host = HostKVCaches(4, caches)
    assert host.slots.is_pinned()
    before = [cache.clone() for cache in caches]
    host.apply(KVTransfers(saves=[(4, 0), (1, 2)]))
    caches[0].add_(1.0)  # the device blocks change after the save was enqueued: the host keeps the old values
    host.apply(KVTransfers(saves=[(5, 1)], loads=[(2, 0), (0, 3), (1, 5)]))
    torch.cuda.synchronize()
    for cache, old in zip(caches, before):
        assert torch.equal(cache[:, 0], old[:, 1]) and torch.equal(cache[:, 3], old[:, 4])
    assert torch.equal(caches[1][:, 5], before[1][:, 5])  # bf16 untouched since: its block 5 saved and back


def test_tensor_parallel_refuses_the_host_tier() -> None:
    with pytest.raises(ValueError, match="kv_offload_gb: the host KV tier runs with tensor_parallel_size 1 only"):
        Config.of(kv_offload_gb=1.0, tensor_parallel_size=2)
