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
step N's token only to mask step N+1's logits: N+1's forward is launched first, and the host waits
for N's tokens and fills the masks while the device runs it (`before_sampling`).

Prefix caching must never hash a placeholder: `KnownTokensKVCacheManager` publishes a block only once
all its tokens are known, and `publish_known` catches up when they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.engine.input_batch import PLACEHOLDER_TOKEN_ID
from services.engine.kv_cache_manager import _ROOT_HASH, KVCacheManager, hash_block
from services.engine.model_runner import StepHandle, StepResult
from services.engine.request import Request
from services.engine.scheduler import SchedulerOutput

__all__ = ["PLACEHOLDER_TOKEN_ID", "InflightStep", "KnownTokensKVCacheManager", "Placeholders", "is_stop_token"]


@dataclass(slots=True)
class SampledRow:
    request: Request
    position: int  # of the placeholder in request.all_token_ids


@dataclass(slots=True)
class InflightStep:
    scheduled: SchedulerOutput
    handle: StepHandle
    rows: list[SampledRow]  # sampling sequences, in the order of the step's sampled ids
    needs_tokens: bool  # a sequence reads its output tokens on the host (penalties): do not overlap
    result: StepResult | None = None  # once waited for
    grammar_ends: list[bool] | None = None  # per row, once its grammar rows took their tokens

    @property
    def has_grammar_rows(self) -> bool:
        return any(row.request.grammar is not None for row in self.rows)

    def pending_rows(self) -> dict[Request, int]:
        """Sequences whose last token is this step's placeholder -> its row in the sampled ids."""
        return {row.request: i for i, row in enumerate(self.rows)}


class Placeholders:
    """Positions of the tokens each sequence is still waiting for (at most two: steps N and N+1)."""

    def __init__(self) -> None:
        self._positions: dict[Request, list[int]] = {}

    def add(self, request: Request, position: int) -> None:
        self._positions.setdefault(request, []).append(position)

    def resolve(self, request: Request, position: int) -> None:
        positions = self._positions[request]
        positions.remove(position)
        if not positions:
            del self._positions[request]

    def num_known_tokens(self, request: Request) -> int:
        positions = self._positions.get(request)
        return positions[0] if positions else request.num_tokens

    def has_unreported(self, request: Request) -> bool:
        """Whether a token of the sequence is still to be reported (not one dropped after a stop)."""
        positions = self._positions.get(request)
        return positions is not None and positions[0] < request.num_tokens

    def __len__(self) -> int:
        return len(self._positions)


class KnownTokensKVCacheManager(KVCacheManager):
    """A KVCacheManager that hashes and publishes only blocks whose tokens are all known."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 num_known_tokens: Callable[[Request], int]) -> None:  # fmt: skip
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self._num_known_tokens = num_known_tokens

    def publish_known(self, request: Request) -> None:
        """Publish the blocks a step filled whose last placeholder was just replaced."""
        block_ids = self._blocks.get(request.seq_id)
        if self.enable_prefix_caching and block_ids:
            self._publish_full_blocks(request, block_ids, request.num_computed_tokens)

    def _extend_hashes(self, request: Request) -> None:
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        for block_index in range(len(hashes), self._num_known_tokens(request) // size):
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, tokens[block_index * size : (block_index + 1) * size]))

    def _publish_full_blocks(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        super()._publish_full_blocks(request, block_ids, min(num_tokens, self._num_known_tokens(request)))


def is_stop_token(request: Request, token_id: int, position: int) -> bool:
    """Whether `token_id` at `position` ends the sequence with "stop" (EOS or a stop id, once
    min_tokens are out): the check `Request.stop_reason_after` makes when the token is appended."""
    num_output = position + 1 - request.num_prompt_tokens
    return num_output >= request.params.min_tokens and (
        token_id in request.eos_token_ids or token_id in request.params.stop_token_ids
    )
