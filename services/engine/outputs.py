"""What the engine hands back: per-step deltas, load statistics, and offline generation results."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the model's raw distribution
    top_logprobs: list[tuple[int, float]]  # the k most likely (token_id, logprob), best first


@dataclass(slots=True)
class RequestOutput:
    """One choice's progress in one step.

    `new_token_ids` includes the token that finished the sequence (an EOS or stop token): what to
    show is the gateway's decision. A continuation's initial tokens are never emitted again."""

    request_id: str
    index: int  # choice index (n > 1)
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None  # None unless the request asked for logprobs
    finish_reason: str | None  # None (running) | "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int  # includes a continuation's initial tokens
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # With the first output token of a request that asked: one entry per prompt token (None first).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # a pooling request's vector, with its (only) output

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int  # since start
    num_prefix_cache_query_tokens: int  # prompt tokens looked up on first admission
    num_prefix_cache_hit_tokens: int  # ... of which found in the cache
    num_computed_tokens: int  # tokens run through the model, since start
    num_generated_tokens: int  # tokens sampled, since start
    num_steps: int
    num_prompt_tokens: int = 0  # prompt tokens prefilled (once per sequence, at its first token), since start
    num_finished_by_reason: dict[str, int] = field(default_factory=dict)  # finished sequences, since start
    num_prefix_cache_host_hit_tokens: int = 0  # of the hits, those copied back from the host-memory tier
    num_host_cached_blocks: int = 0  # prefix blocks the host-memory tier holds now
    # Speculative decoding, since start: verify rows with drafts, drafts, accepted drafts (all and per position).
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.num_prefix_cache_query_tokens
        return self.num_prefix_cache_hit_tokens / queried if queried else 0.0


@dataclass(slots=True)
class Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    text: str | None = None  # decoded when the engine could load the tokenizer


@dataclass(slots=True)
class GenerationResult:
    """One prompt's result from `Engine.generate`; the shortcuts read choice 0."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked: per prompt token, None first

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def text(self) -> str | None:
        return self.choices[0].text

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.choices[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason
