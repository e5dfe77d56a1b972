"""Overlapped steps ("async scheduling"): step N+1 is scheduled and launched before step N's tokens
reach the host, so the GPU never waits for Python between steps.

    engine call k:  schedule N+1 | prepare + launch N+1 | update(N+1, placeholders) | wait N | apply N
    GPU:            ....... N ..........|.................. N+1 ..................................

When a step is launched, the scheduler is told that each sampling sequence got PLACEHOLDER_TOKEN_ID,
so length limits, block allocation and the next schedule can go ahead at once; the next step's input
row for that token is copied on the device from the sampled ids. When step N's tokens arrive they
replace the placeholders (`apply_token`), and an EOS or stop token ends its sequence one step late:
the token computed for it in N+1 is dropped. Steps that need the real output tokens before the next
launch (repetition/presence/frequency penalties read them) do not overlap. Grammar sequences need
step N's token only to mask step N+1's logits: a worker thread waits for N's tokens, advances the grammars
and fills N+1's masks while the engine thread prepares and launches N+1's forward; the engine joins it just
before sampling (structured/mask_worker.py).

Prefix caching must never hash a placeholder: `KnownTokensKVCacheManager` publishes a block only once
all its tokens are known, and `publish_known` catches up when they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.services.engine.block_pool import BlockPool
from pagedserve.services.engine.input_batch import PLACEHOLDER_TOKEN_ID
from pagedserve.services.engine.kv_cache_manager import KVCacheManager, root_hash
from pagedserve.services.engine.kv_offload import HostKVTier
from pagedserve.services.engine.model_runner import StepHandle, StepResult
from pagedserve.services.engine.request import Request
from pagedserve.services.engine.scheduler import SchedulerOutput
from pagedserve.services.engine.structured.mask_worker import StepGrammarTask
from pagedserve.shared import stop_rule
from pagedserve.shared.kv_blocks import hash_block

__all__ = ["PLACEHOLDER_TOKEN_ID", "InflightStep", "KnownTokensKVCacheManager", "Placeholders", "is_stop_token"]


@dataclass(slots=True)
class InflightStep:
    scheduled: SchedulerOutput
    handle: StepHandle
    requests: list[Request]  # sampling sequences, in the order of the step's sampled ids
    positions: list[int]  # of each one's placeholder in its all_token_ids
    needs_tokens: bool  # a sequence reads its output tokens on the host (penalties, bad words): do not overlap
    has_grammar_rows: bool
    result: StepResult | None = None  # once waited for
    grammar_ends: list[bool] | None = None  # per row, once its grammar rows took their tokens
    grammar_task: StepGrammarTask | None = None  # the worker that takes its tokens into the grammars (join first)

    def pending_rows(self) -> dict[Request, int]:
        """Sequences whose last token is this step's placeholder -> its row in the sampled ids."""
        return dict(zip(self.requests, itertools.count()))


class Placeholders:
    """Positions of the tokens each sequence is still waiting for (kept on the request itself:
    `Request.placeholder_positions`, so that a step costs no dict or list churn per row)."""

    def __init__(self) -> None:
        self._num_waiting = 0  # sequences with at least one placeholder

    def add_last(self, requests: list[Request]) -> list[int]:
        """Each request's last token is a new placeholder; returns their positions."""
        positions = []
        num_new = 0
        for request in requests:
            pending = request.placeholder_positions
            position = len(request.all_token_ids) - 1
            if not pending:
                num_new += 1
            pending.append(position)
            positions.append(position)
        self._num_waiting += num_new
        return positions

    def add(self, request: Request, position: int) -> None:
        pending = request.placeholder_positions
        if not pending:
            self._num_waiting += 1
        pending.append(position)

    def resolve(self, request: Request, position: int) -> None:
        pending = request.placeholder_positions
        if pending[0] == position:  # the usual order: step N before N+1
            del pending[0]
        else:
            pending.remove(position)
        if not pending:
            self._num_waiting -= 1

    def num_known_tokens(self, request: Request) -> int:
        pending = request.placeholder_positions
        return pending[0] if pending else len(request.all_token_ids)

    def has_unreported(self, request: Request) -> bool:
        """Whether a token of the sequence is still to be reported (not one dropped after a stop)."""
        pending = request.placeholder_positions
        return bool(pending) and pending[0] < len(request.all_token_ids)

    def __len__(self) -> int:
        return self._num_waiting


class KnownTokensKVCacheManager(KVCacheManager):
    """A KVCacheManager that hashes and publishes only blocks whose tokens are all known."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_known_tokens: Callable[[Request], int],
        host: HostKVTier | None = None,
        window: int | None = None,
        pool: BlockPool | None = None,
        key_suffix: bytes = b"",
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, host, window, pool, key_suffix)
        self._num_known_tokens = num_known_tokens

    def publish_known(self, request: Request) -> None:
        """Publish the blocks a step filled whose last placeholder was just replaced."""
        block_ids = self._blocks.get(request.seq_id)
        if self.enable_prefix_caching and block_ids:
            self._publish_full_blocks(request, block_ids, request.num_computed_tokens)

    def _extend_hashes(self, request: Request) -> None:
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        for block_index in range(len(hashes), self._num_known_tokens(request) // size):
            parent = hashes[-1] if hashes else root_hash(request)
            hashes.append(hash_block(parent, tokens[block_index * size : (block_index + 1) * size]))

    def _publish_full_blocks(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        super()._publish_full_blocks(request, block_ids, min(num_tokens, self._num_known_tokens(request)))


def is_stop_token(request: Request, token_id: int, position: int) -> bool:
    """Whether `token_id` at `position` ends the sequence with "stop" (EOS or a stop id, once
    min_tokens are out): the check `Request.stop_reason_after` makes when the token is appended."""
    return stop_rule.is_stop_token(
        token_id,
        position + 1 - request.num_prompt_tokens,
        request.min_tokens_now,
        request.eos_token_ids,
        request.params.stop_token_ids,
    )
