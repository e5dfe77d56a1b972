"""Speculative decoding: a proposer drafts up to k tokens per decoding sequence, and one target forward verifies
them all (`--speculative-config`, vLLM's JSON).

    before schedule   SpeculativeDecoding.draft(running): request.spec_token_ids = proposer's drafts
    schedule          a drafted sequence asks for 1 + k tokens (its last known token, then the drafts); the
                      budget may cut drafts, never the last token (scheduler._scheduled)
    forward           the drafts' K/V is written into the sequence's own blocks, like a prefill chunk;
                      logits at all k + 1 positions (input_batch.build_host_batch)
    verify            verify.py / rejection_sampler.py: accepted drafts + one token of the target's own
    update            Scheduler.update_verified: tokens appended up to a stop; the computed count steps back
                      over the rejected drafts, whose K/V slots are simply written again later

A step with drafts cannot overlap the next (the next step's inputs depend on how many were accepted), so the
engine runs without async scheduling when speculation is on. Sequences with a grammar get no drafts (they
decode one token per step, masked as usual); so do sequences whose prefill is not complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.services.engine.request import Request
from pagedserve.services.engine.spec_decode.verify import VerifiedTokens


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], max_num_tokens: Sequence[int]) -> list[list[int]]:
        """Per request, at most its `max_num_tokens` drafts continuing its `all_token_ids`."""
        ...


@dataclass(slots=True)
class SpecDecodeCounters:
    """Cumulative, since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verify rows that had at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at draft position i


class SpeculativeDecoding:
    def __init__(self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.counters = SpecDecodeCounters(num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def draft(self, running: Sequence[Request]) -> None:
        """Set every running sequence's drafts for the next step (none unless it is decoding)."""
        wanting, limits = [], []
        for request in running:
            if request.spec_token_ids:
                request.spec_token_ids = []
            if request.num_tokens - request.num_computed_tokens != 1 or request.grammar is not None:
                continue
            # Drafts + the target's token must fit max_tokens and the context (the K/V of the last draft too).
            room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
            k = min(self.num_speculative_tokens, room)
            if k > 0:
                wanting.append(request)
                limits.append(k)
        if wanting:
            for request, drafts in zip(wanting, self.proposer.propose(wanting, limits), strict=True):
                request.spec_token_ids = drafts

    def record(self, verified: VerifiedTokens) -> None:
        counters = self.counters
        per_pos = counters.num_accepted_tokens_per_pos
        for num_drafts, num_accepted in zip(verified.num_drafts, verified.num_accepted):
            if not num_drafts:
                continue
            counters.num_drafts += 1
            counters.num_draft_tokens += num_drafts
            counters.num_accepted_tokens += num_accepted
            for pos in range(num_accepted):
                per_pos[pos] += 1
