"""Which engine replica a prompt goes to: the one whose KV cache already holds the most of its prefix,
unless the load there makes computing it elsewhere cheaper (the idea of Dynamo's KV router and SGLang's
cache-aware router).

    KV events ──► PrefixIndex (block -> replicas)  ┐
    heartbeats ─► load (KV blocks in use) ─────────┴─► PrefixRouter.route(prompt) ─► one engine's stream
                                                                                  or the shared stream

The policy is SGLang's cache-aware one, with the load known from the replicas' own reports (KV events
come after every step that changes it; heartbeats every second) plus the requests routed since:

- the replica holding the longest prefix of the prompt gets it, when that prefix is worth it (at least
  min_hit_blocks blocks, or min_hit_ratio of the prompt and min_hit_tokens long: a short chat's shared
  system-prompt block is half its prompt, and would send a whole burst to one replica) and the loads
  are balanced;
- a prompt with no such prefix anywhere goes to the shared stream, where whichever replica has room
  pulls it: pull-based balancing stays for new work;
- so does one whose best replica has max_queued requests waiting (no room), or carries more than
  max_imbalance requests above the least loaded replica: a hot prefix then spreads to a second one;
- a request for a LoRA adapter is weighed only among the replicas holding that adapter in a device slot
  (heartbeat `lora_resident`) when some but not all do: another replica would first have to load it,
  maybe evicting one its running requests use; with no prefix hit it goes to the least loaded holder;
- OpenAI's `prompt_cache_key` is a hint for prompts with no such prefix yet (a conversation's first turns,
  or a burst before the replicas' KV events arrive): a key's requests go where its last one went (the
  least loaded replica the first time), under the same room and balance rules.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.shared import kv_blocks
from pagedserve.shared.protocol import EngineHeartbeat, KVEvents

_MAX_ROUTED_AGE_S = 5.0
HOST_HIT_WEIGHT = 0.5  # a prefix block in a replica's host tier, against one in its device cache
_MAX_CACHE_KEYS = 100_000  # prompt_cache_key -> replica, least recently used dropped first


@dataclass(slots=True)
class Load:
    time: float  # the replica's wall clock when it was so
    num_running: int
    num_waiting: int
    num_used_blocks: int  # physical: a prefix shared by several sequences counts once


class PrefixIndex:
    """Which replica holds which prefix block (blocks named by `kv_blocks.wire_id`), and each one's load as
    of its last KV event, fed by KV events."""

    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}  # engine id -> the blocks its cache holds
        self._host: dict[str, set[int]] = {}  # engine id -> the blocks its host-memory tier holds
        self.loads: dict[str, Load] = {}

    def apply(self, events: KVEvents) -> None:
        if events.time:
            self.loads[events.engine_id] = Load(
                events.time, events.num_running, events.num_waiting, events.num_used_blocks
            )
        if events.snapshot:
            self._blocks[events.engine_id] = set(events.stored)
            self._host[events.engine_id] = set(events.host_stored)
            return
        for tiers, stored, removed in (
            (self._blocks, events.stored, events.removed),
            (self._host, events.host_stored, events.host_removed),
        ):
            blocks = tiers.setdefault(events.engine_id, set())
            blocks.difference_update(removed)
            blocks.update(stored)

    def drop(self, engine_id: str) -> None:
        self._blocks.pop(engine_id, None)
        self._host.pop(engine_id, None)
        self.loads.pop(engine_id, None)

    def engines(self) -> list[str]:
        return list(self._blocks)

    def num_blocks(self, engine_id: str) -> int:
        return len(self._blocks.get(engine_id, ()))

    def overlap(self, engine_id: str, block_ids: Sequence[int]) -> int:
        """How many leading blocks of a prompt the replica holds (a later block is of no use without them)."""
        held = self._blocks.get(engine_id)
        if not held:
            return 0
        for count, block_id in enumerate(block_ids):
            if block_id not in held:
                return count
        return len(block_ids)

    def host_overlap(self, engine_id: str, block_ids: Sequence[int], start: int) -> int:
        """How many blocks after the first `start` (the device hit) the replica's host tier goes on with."""
        host, device = self._host.get(engine_id), self._blocks.get(engine_id, set())
        if not host:
            return 0
        count = 0
        for block_id in block_ids[start:]:
            if block_id in host:
                count += 1
            elif block_id not in device:
                break
        return count


@dataclass(slots=True)
class RouteDecision:
    engine_id: str | None  # None: the shared stream
    reason: str  # prefix | cache_key | adapter | no_overlap | overflow | single_engine | load
    overlap_blocks: int = 0  # device and host-tier blocks
    prompt_blocks: int = 0


@dataclass(slots=True)
class _Routed:
    at: float  # wall clock, comparable with heartbeat times
    num_blocks: int


@dataclass(slots=True)
class PrefixRouter:
    index: PrefixIndex = field(default_factory=PrefixIndex)
    max_queued: int = 4  # a replica with this many requests waiting (no room to run them) gets no more
    max_imbalance: int = 16  # requests more than the least loaded replica before a prefix hit stops counting
    min_hit_blocks: int = 32  # a hit this long is worth routing for (512 tokens of 16)...
    min_hit_ratio: float = 0.5  # ...and so is one covering this share of the prompt...
    min_hit_tokens: int = 64  # ...if it is at least this long
    _routed: dict[str, list[_Routed]] = field(default_factory=dict)
    _live: set[str] = field(default_factory=set)
    _keyed: OrderedDict[str, str] = field(default_factory=OrderedDict)  # prompt_cache_key -> replica

    def route(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        engines: Sequence[EngineHeartbeat],
        cache_key: str | None = None,
        lora_name: str | None = None,
    ) -> RouteDecision:
        live = [e for e in engines if not e.is_draining and e.block_size > 0]
        if len(live) < 2:  # one replica pulls everything anyway
            return RouteDecision(None, "single_engine")
        holders = [e for e in live if lora_name in e.lora_resident] if lora_name else []
        is_adapter_routed = bool(holders) and len(holders) < len(live)
        if is_adapter_routed:
            live = holders
        hashes: dict[int, list[int]] = {}  # per block size (replicas normally share one)
        for size in {e.block_size for e in live}:
            hashes[size] = [
                kv_blocks.wire_id(h) for h in kv_blocks.block_hashes(token_ids, size, cache_salt, lora_name)
            ]
        device_hits = {e.engine_id: self.index.overlap(e.engine_id, hashes[e.block_size]) for e in live}
        host_hits = {
            e.engine_id: self.index.host_overlap(e.engine_id, hashes[e.block_size], device_hits[e.engine_id])
            for e in live
        }
        hits = {e: device_hits[e] + host_hits[e] for e in device_hits}
        loads = {e.engine_id: self._queued(e) for e in live}
        # the longest prefix, a block in host memory worth less than one on the device (it is copied back);
        # among equals, the least loaded
        best = max(
            live,
            key=lambda e: (device_hits[e.engine_id] + HOST_HIT_WEIGHT * host_hits[e.engine_id], -loads[e.engine_id]),
        )
        hit, num_blocks = hits[best.engine_id], len(hashes[best.block_size])
        reason = "prefix"
        is_share = hit >= self.min_hit_ratio * num_blocks and hit * best.block_size >= self.min_hit_tokens
        if hit == 0 or (hit < self.min_hit_blocks and not is_share):
            if cache_key is None and not is_adapter_routed:
                return RouteDecision(None, "no_overlap", hit, num_blocks)
            by_id = {e.engine_id: e for e in live}
            keyed = by_id.get(self._keyed.get(cache_key, "")) if cache_key is not None else None
            best = keyed or min(live, key=lambda e: loads[e.engine_id])
            reason = "cache_key" if cache_key is not None else "adapter"
            hit, num_blocks = hits[best.engine_id], len(hashes[best.block_size])
        if self.load_of(best).num_waiting >= self.max_queued:  # it has no room now
            return RouteDecision(None, "overflow", hit, num_blocks)
        if loads[best.engine_id] - min(loads.values()) > self.max_imbalance:
            return RouteDecision(None, "load", hit, num_blocks)
        self._routed.setdefault(best.engine_id, []).append(_Routed(time.time(), num_blocks))
        if cache_key is not None:
            self._remember(cache_key, best.engine_id)
        return RouteDecision(best.engine_id, reason, hit, num_blocks)

    def _remember(self, cache_key: str, engine_id: str) -> None:
        self._keyed[cache_key] = engine_id
        self._keyed.move_to_end(cache_key)
        if len(self._keyed) > _MAX_CACHE_KEYS:
            self._keyed.popitem(last=False)

    def _queued(self, engine: EngineHeartbeat) -> int:
        """Requests on the replica: running and waiting as of its latest report, plus those routed since."""
        load = self.load_of(engine)
        return load.num_running + load.num_waiting + len(self._recent(load, engine))

    def forget_gone(self, live_engine_ids: set[str]) -> None:
        """Drop what is known of replicas that were live and are gone (their heartbeat expired). One not
        seen live yet keeps its blocks: its first KV events may come before its first heartbeat."""
        for engine_id in self._live - live_engine_ids:
            self.index.drop(engine_id)
            self._routed.pop(engine_id, None)
        self._live = set(live_engine_ids)

    def load_of(self, engine: EngineHeartbeat) -> Load:
        """The replica's latest load: from its last KV event (sent after any step that changed it) or its
        heartbeat (every second), whichever is newer."""
        reported = self.index.loads.get(engine.engine_id)
        if reported is not None and reported.time >= engine.time:
            return reported
        used = engine.num_total_blocks - engine.num_free_blocks
        return Load(engine.time, engine.num_running, engine.num_waiting, used)

    def _recent(self, load: Load, engine: EngineHeartbeat) -> list[_Routed]:
        """Requests routed to `engine` after its load was reported (so not counted in it yet)."""
        routed = self._routed.get(engine.engine_id)
        if not routed:
            return []
        now = time.time()
        # after the report, and recent: a replica's clock may lag ours
        routed[:] = [r for r in routed if r.at > load.time and now - r.at < _MAX_ROUTED_AGE_S]
        return routed
