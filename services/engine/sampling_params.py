"""Per-request sampling parameters, validated once when a request enters the engine.

The gateway validates user input and answers in the OpenAI error shape; `validate()` here is the
engine's own guard (a ValueError naming the parameter) so the offline API is equally safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedserve.shared.grammar_spec import GrammarSpec

MAX_LOGPROBS = 20
_EPS_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # over prompt and output tokens, 1 = off
    presence_penalty: float = 0.0  # over output tokens, 0 = off
    frequency_penalty: float = 0.0  # over output tokens, 0 = off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    seed: int | None = None  # a private generator: same seed, same tokens, whatever the neighbours
    n: int = 1  # choices; they share the prompt's KV blocks
    logprobs: int | None = None  # None = none; k = the sampled token's logprob plus the top k (k <= 20)
    max_tokens: int | None = None  # None = whatever context is left
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many tokens exist
    min_characters: int = 0  # ... and until the output's text has this many characters (token_chars.py)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    prompt_logprobs: int | None = None  # None = none; k = each prompt token's logprob plus the top k
    structured_output: GrammarSpec | None = None  # constrained decoding (json schema, regex, ...)
    priority: int = 0  # lower runs first, under the priority scheduling policy (vLLM's meaning)
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words_token_ids: list[list[int]] | None = None  # token sequences never completed in the output
    cache_salt: str | None = None  # prefix-cache isolation: only requests with the same salt share blocks
    reasoning_start_ids: list[list[int]] | None = None  # the reasoning block's openers (token ids)
    reasoning_end_ids: list[list[int]] | None = None  # structured_output applies once one of these is written

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reads_output_tokens(self) -> bool:
        """The sampling of the next token reads the output so far on the host (an overlapped step must wait)."""
        return self.has_penalties or any(len(word) > 1 for word in self.bad_words_token_ids or ())

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad parameter."""
        _check(self.temperature >= 0.0, "temperature", "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive count")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.n >= 1, "n", "must be >= 1")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [0, {MAX_LOGPROBS}]"
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"must be in [0, {MAX_LOGPROBS}]",
        )
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        _check(self.min_characters >= 0, "min_characters", "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids", "must not be empty"
        )
        _check(all(self.bad_words_token_ids or ()), "bad_words", "a bad word has no tokens")
        ids = [
            *self.stop_token_ids,
            *(self.logit_bias or ()),
            *(self.allowed_token_ids or ()),
            *(t for word in self.bad_words_token_ids or () for t in word),
        ]
        if vocab_size is not None:
            _check(
                all(0 <= t < vocab_size for t in ids),
                "stop_token_ids/logit_bias/allowed_token_ids/bad_words",
                "token id out of range",
            )
        for value in (self.logit_bias or {}).values():
            _check(-100.0 <= value <= 100.0, "logit_bias", "values must be in [-100, 100]")

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an n>1 request: n=1, and a distinct derived seed.
        Only choice 0 computes prompt logprobs (the choices share the prompt)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)


def _check(is_ok: bool, name: str, message: str) -> None:
    if not is_ok:
        raise ValueError(f"{name}: {message}")
