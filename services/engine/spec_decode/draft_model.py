"""Drafting with a small model that shares the target's tokenizer: k greedy tokens per sequence.

The draft model has its own paged KV cache (a KVCacheManager without prefix caching) and its own ModelRunner;
each target sequence has a shadow Request there. Before drafting, the shadow's tokens are brought in line with
the target's: its K/V stays valid up to the first token where they differ (the first rejected draft), and its
computed count rolls back to there, so the draft model only ever computes the tokens it has not seen:

    target  p p p p a a d0 d1 d2  ->  p p p p a a d0 T   (d0 accepted, d1 rejected: the target's T instead)
    shadow  computed up to d1     ->  computed up to d0, then T and k new drafts are run

Drafting is greedy, so the draft distribution is a point mass and rejection sampling stays exact
(rejection_sampler.py). A shadow goes when its sequence stops asking for drafts (finished or preempted).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.services.engine.kv_cache_manager import KVCacheManager
from pagedserve.services.engine.model_runner import ModelRunner
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.scheduler import ScheduledRequest

_GREEDY = SamplingParams(temperature=0.0)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.kv_cache = KVCacheManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.max_num_batched_tokens = max_num_batched_tokens
        self._shadows: dict[str, Request] = {}  # target seq_id -> its shadow
        self._synced: dict[str, int] = {}  # target seq_id -> tokens known equal to the target's at the last call

    @classmethod
    def build(cls, model: CausalLM, target: ModelRunner, max_num_batched_tokens: int) -> DraftModelProposer:
        """A draft runner with as many KV blocks as the target's (the same tokens fit) and no CUDA graphs."""
        runner = ModelRunner(
            model,
            target.num_blocks,
            target.block_size,
            target.device,
            seed=0,
            max_num_seqs=target.buffers.max_num_seqs if target.buffers is not None else 256,
            max_num_tokens=max_num_batched_tokens,
            max_model_len=target.max_model_len,
        )
        return cls(runner, max_num_batched_tokens)

    def propose(self, requests: Sequence[Request], max_num_tokens: Sequence[int]) -> list[list[int]]:
        wanted = {r.seq_id for r in requests}
        for seq_id in [s for s in self._shadows if s not in wanted]:
            self.kv_cache.free(self._shadows.pop(seq_id))
            del self._synced[seq_id]
        shadows = [self._sync(r) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, k in enumerate(max_num_tokens) if k > 0]
        while active:
            scheduled, rows, no_room = self._schedule(shadows, active)
            if not scheduled:
                break
            result = self.runner.execute(scheduled, self.kv_cache.block_tables(s.request for s in scheduled))
            sampled = iter(result.sampled_token_ids)
            for item, i in zip(scheduled, rows):
                item.request.num_computed_tokens += item.num_new_tokens
                if item.is_sampling:
                    token_id = next(sampled)
                    item.request.all_token_ids.append(token_id)
                    drafts[i].append(token_id)
            active = [i for i in active if len(drafts[i]) < max_num_tokens[i] and i not in no_room]
        return drafts

    def _sync(self, request: Request) -> Request:
        """The request's shadow, its tokens made equal to the target's and its computed count cut back to them."""
        seq_id, target = request.seq_id, request.all_token_ids
        shadow = self._shadows.get(seq_id)
        if shadow is None:
            shadow = Request.create(seq_id, 0, target, [], _GREEDY, len(target), frozenset(), 0, self.runner.device)
            self._shadows[seq_id] = shadow
            self._synced[seq_id] = len(target)
            return shadow
        tokens, same = shadow.all_token_ids, self._synced[seq_id]
        limit = min(len(tokens), len(target))
        while same < limit and tokens[same] == target[same]:
            same += 1
        del tokens[same:]
        tokens.extend(target[same:])
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same)
        self._synced[seq_id] = len(target)
        return shadow

    def _schedule(
        self, shadows: list[Request], active: list[int]
    ) -> tuple[list[ScheduledRequest], list[int], set[int]]:
        """One draft step: each active shadow computes what it has not (a long catch-up in budget-sized
        chunks); those that reach their last token sample a draft. Shadows with no KV room draft no more."""
        scheduled, rows, no_room, budget = [], [], set(), self.max_num_batched_tokens
        for i in active:
            if budget <= 0:
                break  # the rest go on in the next draft step
            shadow = shadows[i]
            num_new = min(shadow.num_tokens - shadow.num_computed_tokens, budget)
            assert num_new > 0, "a shadow drafts from a token it has not computed"
            num_total = shadow.num_computed_tokens + num_new
            if self.kv_cache.allocate(shadow, num_total) is None:
                no_room.add(i)
                continue
            scheduled.append(
                ScheduledRequest(shadow, shadow.num_computed_tokens, num_new, num_total == shadow.num_tokens)
            )
            rows.append(i)
            budget -= num_new
        return scheduled, rows, no_room
