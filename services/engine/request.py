"""One sequence's state inside the engine (a request with n choices becomes n of these).

Ownership, so that no two classes update the same counter:
  num_computed_tokens, status       -> Scheduler (admission and its update step)
  all_token_ids (appends)          -> Scheduler update step (the sampled token)
  block_hashes, num_hashed_blocks  -> KVCacheManager
  finish_reason                    -> Scheduler (stop checks) / Engine (abort)
  placeholder_positions            -> async_steps.Placeholders (overlapped steps)
  pooled_state                     -> pooler.pool_step (a pooling request's running sum or first row)
  spec_token_ids                   -> the engine's proposer (speculative decoding), before each schedule
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedserve.services.engine.outputs import TokenLogprob
from pagedserve.services.engine.pooling_config import PoolingParams
from pagedserve.services.engine.sampling_params import SamplingParams
from pagedserve.services.engine.structured.state import GrammarState
from pagedserve.shared.stop_rule import stop_reason


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted (its blocks freed; it recomputes when readmitted)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str  # the caller's id, shared by the n choices
    index: int  # choice index within the request
    prompt_token_ids: list[int]
    params: SamplingParams  # n == 1 here; a choice's own seed
    max_tokens: int  # resolved: never None, counts the continuation tokens too
    eos_token_ids: frozenset[int]  # empty when ignore_eos
    arrival_seq: int  # FCFS order
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output tokens
    num_initial_output_tokens: int = 0  # a continuation's tokens another replica already emitted
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = -1  # prefix-cache hit on first admission (-1 = not admitted yet)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full token blocks
    generator: torch.Generator | None = None  # only with a seed
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # [None, pos 1, ...] when asked
    grammar: GrammarState | None = None  # only with structured output (set by the engine)
    # Positions of sampled tokens the host has not seen yet (at most two: steps N and N+1).
    placeholder_positions: list[int] = field(default_factory=list)
    token_chars: Sequence[int] | None = None  # characters per token id, with min_characters (set by the engine)
    has_min_characters: bool = False  # the output's text reached min_characters (it only grows)
    pooling: PoolingParams | None = None  # an embedding request: its prompt is pooled, nothing sampled
    pooled_state: torch.Tensor | None = None  # [hidden] float32 on the device, between prompt chunks
    spec_token_ids: list[int] = field(default_factory=list)  # drafted tokens to verify after the last one
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model); roots its block hashes
    lora_slot: int = -1  # the device slot holding that adapter, pinned while the request lives (engine)
    seq_id: str = field(init=False)  # "request_id#index": the KV cache's key, read every step
    reads_output_tokens: bool = field(init=False)  # params.reads_output_tokens, read every step

    def __post_init__(self) -> None:
        self.seq_id = f"{self.request_id}#{self.index}"
        self.reads_output_tokens = self.params.reads_output_tokens

    @classmethod
    def create(
        cls,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        arrival_seq: int,
        device: torch.device,
    ) -> Request:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(
            request_id=request_id,
            index=index,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else eos_token_ids,
            arrival_seq=arrival_seq,
            all_token_ids=list(prompt_token_ids) + list(output_token_ids),
            num_initial_output_tokens=len(output_token_ids),
            generator=generator,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def stop_reason_after(self, token_id: int, max_model_len: int) -> str | None:
        """Why the sequence ends now that `token_id` was appended, or None to go on (shared/stop_rule.py)."""
        return stop_reason(
            token_id,
            self.num_output_tokens,
            self.num_tokens,
            min_tokens=self.min_tokens_now,
            max_tokens=self.max_tokens,
            max_model_len=max_model_len,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=self.params.stop_token_ids,
        )

    @property
    def is_min_tokens_pending(self) -> bool:
        """EOS/stop tokens are masked out of sampling while this holds."""
        return self.num_output_tokens < self.params.min_tokens or self.is_min_characters_pending

    @property
    def min_tokens_now(self) -> int:
        """The output length from which a stop token ends the sequence: min_tokens, or never while the text
        is short of min_characters."""
        return sys.maxsize if self.is_min_characters_pending else self.params.min_tokens

    @property
    def is_min_characters_pending(self) -> bool:
        if self.has_min_characters or not self.params.min_characters or self.token_chars is None:
            return False
        chars, table = 0, self.token_chars
        for token_id in self.output_token_ids:  # placeholders (not sampled yet) are out of range: 0
            chars += table[token_id] if 0 <= token_id < len(table) else 0
        self.has_min_characters = chars >= self.params.min_characters
        return not self.has_min_characters
