"""Continuous batching with no prefill/decode phases (the vLLM v1 rule).

Every step, each running sequence's computed tokens catch up with its known tokens, under a token
budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). A prompt longer than the
budget is therefore prefilled in chunks, and prefills and decodes share a step:

    running  A: 1 token (decode)   B: 1 token (decode)   C: 300 of 900 prompt tokens (a chunk)
    waiting  D: admitted in policy order if blocks and budget remain and nobody was preempted this step

When a running sequence needs a block and none is free, the last running sequence is preempted: its
blocks are freed and it goes back to the waiting queue, to be recomputed (cheaply, its blocks usually
still sit in the prefix cache). Running out of KV memory never raises. The policy (waiting_queue.py)
orders both ends: under `fcfs` the running list is in admission order (the newest goes first) and the
waiting queue in arrival order; under `priority` both are ordered by (priority, arrival), so admission
takes the most urgent first and preemption takes the least urgent.

The scheduler is the one writer of `num_computed_tokens`, `status`, the appended output tokens and
the stop decision (in `update`). It never sees a tensor.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.request import Request, RequestStatus
from pagedserve.services.engine.waiting_queue import priority_key, waiting_queue


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # before this step: the first new token's position
    num_new_tokens: int
    is_sampling: bool  # this step computes the last known token, so a new one is sampled (never when pooling)
    spec_token_ids: Sequence[int] = ()  # drafts run after the last known token, to be verified


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SchedulerCounters:
    num_preemptions: int = 0
    num_prefix_cache_query_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0
    num_prefix_cache_host_hit_tokens: int = 0  # of the hits, those in the host-memory tier
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompts whose prefill completed (first token sampled)
    num_finished_by_reason: dict[str, int] = field(default_factory=dict)  # "stop", "length", "abort"


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
    ) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting = waiting_queue(policy)
        self.running: list[Request] = []  # policy order: the last is preempted first
        self._by_priority = policy == "priority"
        self.counters = SchedulerCounters()

    def add(self, request: Request) -> None:
        assert request.status is RequestStatus.WAITING and request.num_tokens < self.max_model_len
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        scheduled, running, kv_cache = output.scheduled, self.running, self.kv_cache
        budget = self.max_num_batched_tokens
        if kv_cache.frees_out_of_window:  # sliding layers' blocks behind their window go back to the pool
            for request in running:
                kv_cache.release_out_of_window(request)
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            num_new = len(request.all_token_ids) + len(request.spec_token_ids) - num_computed
            if num_new == 1 and request.pooling is None and kv_cache.fits_in_place(request, num_computed + 1):
                # The common decode row: no block to take, nothing to publish (allocate would be a no-op).
                scheduled.append(ScheduledRequest(request, num_computed, 1, True))
                budget -= 1
                index += 1
                continue
            num_new = min(num_new, budget)
            if request.spec_token_ids and kv_cache.allocate(request, num_computed + num_new) is None:
                request.spec_token_ids = []  # drafts never take a block from another sequence: verify none
                num_new = min(len(request.all_token_ids) - num_computed, budget)
            if not self._allocate_or_preempt(request, num_new, output.preempted):
                break  # `request` itself was the newest and got preempted: nobody is left after it
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
            index += 1
        if not output.preempted:  # admitting now would only evict what a running sequence needs
            budget = self._admit_waiting(budget, output)
        self.counters.num_steps += 1
        return output

    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Apply a step's results: computed tokens advance, sampling sequences get their token
        (in `output.scheduled` order) and may finish. Returns the sequences that got a token."""
        if len(sampled_token_ids) != sum(1 for s in output.scheduled if s.is_sampling):
            raise ValueError("sampled_token_ids do not match the sampling sequences")
        sampled = iter(sampled_token_ids)
        updated = []
        max_model_len = self.max_model_len
        num_computed = 0
        has_finished = False
        for item in output.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            num_computed += item.num_new_tokens
            if not item.is_sampling:
                if request.pooling is not None and request.num_computed_tokens == request.num_tokens:
                    self.counters.num_prompt_tokens += request.num_tokens
                    self._release(request, "stop")  # pooled: its prompt was all it had to compute
                    has_finished = True
                continue
            token_id = next(sampled)
            tokens = request.all_token_ids
            tokens.append(token_id)
            if len(tokens) - len(request.prompt_token_ids) == 1:  # prefill done: counted once, as vLLM does
                self.counters.num_prompt_tokens += len(request.prompt_token_ids)
            # A cheap superset of the stop rule's conditions (shared/stop_rule.py; min_tokens aside) keeps most
            # rows off it.
            if (
                len(tokens) - len(request.prompt_token_ids) >= request.max_tokens
                or len(tokens) >= max_model_len
                or token_id in request.eos_token_ids
                or token_id in request.params.stop_token_ids
            ):
                reason = request.stop_reason_after(token_id, max_model_len)
                if reason is not None:
                    self._release(request, reason)
                    has_finished = True
            updated.append(request)
        self.counters.num_computed_tokens += num_computed
        self.counters.num_generated_tokens += len(updated)
        if has_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return updated

    def update_verified(self, output: SchedulerOutput, token_ids: Sequence[Sequence[int]]) -> list[Request]:
        """Apply a speculative step: each sampling sequence gets its accepted drafts and the target's own token
        (in `output.scheduled` order), cut at the first that ends it. A sequence's computed tokens step back over
        its rejected drafts: their K/V slots are simply written again later. Returns the sequences that got any."""
        if len(token_ids) != sum(1 for s in output.scheduled if s.is_sampling):
            raise ValueError("token_ids do not match the sampling sequences")
        rows = iter(token_ids)
        updated = []
        has_finished = False
        for item in output.scheduled:
            request = item.request
            self.counters.num_computed_tokens += item.num_new_tokens
            if not item.is_sampling:
                request.num_computed_tokens += item.num_new_tokens
                continue
            new_ids = next(rows)
            num_rejected = len(item.spec_token_ids) - (len(new_ids) - 1)
            assert 0 <= num_rejected <= len(item.spec_token_ids), "more tokens than drafts + 1"
            request.num_computed_tokens += item.num_new_tokens - num_rejected
            tokens = request.all_token_ids
            if len(tokens) == len(request.prompt_token_ids):  # prefill done: counted once, as vLLM does
                self.counters.num_prompt_tokens += len(request.prompt_token_ids)
            for token_id in new_ids:
                tokens.append(token_id)
                self.counters.num_generated_tokens += 1
                reason = request.stop_reason_after(token_id, self.max_model_len)
                if reason is not None:
                    self._release(request, reason)
                    has_finished = True
                    break
            updated.append(request)
        if has_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return updated

    def finish(self, requests: Sequence[Request], reason: str) -> None:
        """End sequences from outside the step (abort); idempotent."""
        requests = [r for r in requests if not r.is_finished]
        for request in requests:
            if request.status is RequestStatus.WAITING:
                with contextlib.suppress(ValueError):  # it may never have been queued
                    self.waiting.remove(request)
            self._release(request, reason)
        if requests:
            self.running = [r for r in self.running if not r.is_finished]

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        num_computed = request.num_computed_tokens
        num_spec = num_computed + num_new - request.num_tokens  # drafts that fit the budget (speculative decoding)
        if num_spec > 0:
            return ScheduledRequest(request, num_computed, num_new, True, request.spec_token_ids[:num_spec])
        is_last = num_computed + num_new == request.num_tokens
        return ScheduledRequest(request, num_computed, num_new, is_last and request.pooling is None)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[Request]) -> bool:
        """Blocks for `num_new` more tokens of a running sequence, preempting the last running (the
        newest, or the least urgent) until they fit; False if `request` itself had to go. The victims
        all come after `request` in the running list, so none of them was scheduled this step."""
        num_tokens = request.num_computed_tokens + num_new
        while self.kv_cache.allocate(request, num_tokens) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit_waiting(self, budget: int, output: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            # cached positions would have no logits, or no hidden states to pool
            skip_cache = request.params.prompt_logprobs is not None or (
                request.pooling is not None and request.pooling.needs_every_row
            )
            hit_block_ids, num_hit_tokens = ([], 0) if skip_cache else self.kv_cache.get_computed_blocks(request)
            num_host_hit_tokens = self.kv_cache.num_host_hit_tokens(request) if num_hit_tokens else 0
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache.allocate(request, num_hit_tokens + num_new, hit_block_ids) is None:
                break  # nobody overtakes the head of the queue
            self.waiting.pop()
            if request.num_cached_tokens < 0:  # first admission: count the prompt's cache use once
                request.num_cached_tokens = num_hit_tokens
                self.counters.num_prefix_cache_query_tokens += request.num_tokens
                self.counters.num_prefix_cache_hit_tokens += num_hit_tokens
                self.counters.num_prefix_cache_host_hit_tokens += num_host_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if self._by_priority:
                bisect.insort(self.running, request, key=priority_key)
            else:
                self.running.append(request)
            output.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.add_preempted(request)
        self.counters.num_preemptions += 1

    def _release(self, request: Request, reason: str) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        finished = self.counters.num_finished_by_reason
        finished[reason] = finished.get(reason, 0) + 1
