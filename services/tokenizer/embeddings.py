"""An /v1/embeddings input -> the pooling request an embedding engine runs, with its checks (no Redis here).

The input is tokenized as a completion prompt (special tokens added, as vLLM does; token ids pass through)
and must fit the context the engines serve: no token is generated, so it may use all but the last position
(the engine's rule for any prompt). `dimensions` (Matryoshka) follows vLLM's rule: only for a model whose
config.json says `is_matryoshka: true` or lists `matryoshka_dimensions` (then it must be one of them), and
never above the hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pagedserve.shared.prompts import first_out_of_vocab, text_prompt_ids
from pagedserve.shared.protocol import Accepted, CompletionRequest, GenerateRequest, RequestError, Sampling


class EmbeddingLimits(Protocol):
    """What this reads of the model's limits (processor.ModelLimits)."""

    vocab_size: int | None
    hidden_size: int | None
    is_matryoshka: bool
    matryoshka_dimensions: list[int] | None


def process_embedding(
    tokenizer: Any,
    limits: EmbeddingLimits,
    context_limit: int,
    req: CompletionRequest,
    truncate: Callable[[list[int], Sampling], list[int]],
) -> tuple[Accepted, GenerateRequest] | RequestError:
    """The Accepted and the engine's request, or the 400; `req.pooling` is set. `truncate`: vLLM's
    truncate_prompt_tokens (the processor's rule), before the length check."""
    assert req.pooling is not None
    dimensions = req.pooling.get("dimensions")
    problem = dimensions_problem(limits, dimensions)
    if problem is not None:
        return RequestError(req.request_id, 400, problem, param="dimensions")
    try:
        prompt_ids = text_prompt_ids(tokenizer, req.prompt)
    except Exception as exc:  # a tokenizer error comes from user content: answer 400, keep serving
        return RequestError(req.request_id, 400, f"could not tokenize the input: {exc}", param="input")
    prompt_ids = truncate(prompt_ids, req.sampling)
    vocab = limits.vocab_size or len(tokenizer)
    if not prompt_ids:
        return RequestError(req.request_id, 400, "the input is empty", param="input")
    if first_out_of_vocab(prompt_ids, vocab) is not None:
        return RequestError(req.request_id, 400, f"input token ids must be in [0, {vocab})", param="input")
    if len(prompt_ids) >= context_limit:
        return RequestError(
            req.request_id,
            400,
            f"This model's maximum context length is {context_limit} tokens. However, you requested "
            f"{len(prompt_ids)} tokens in the input for embedding generation. Please reduce the length of the input.",
            param="input",
            code="context_length_exceeded",
        )
    accepted = Accepted(req.request_id, len(prompt_ids), 1, prompt_token_ids=prompt_ids)
    generate = GenerateRequest(
        request_id=req.request_id,
        reply_to=req.reply_to,
        model=req.model,
        prompt_token_ids=prompt_ids,
        sampling={"max_tokens": 1},
        arrival_time=req.arrival_time,
        traceparent=req.traceparent,
        pooling={"dimensions": dimensions},
    )
    return accepted, generate


def dimensions_problem(limits: EmbeddingLimits, dimensions: int | None) -> str | None:
    """Why `dimensions` cannot be served for this model, or None when it can (or was not given)."""
    if dimensions is None:
        return None
    if not limits.is_matryoshka:
        return "This model does not support matryoshka representation; dimensions cannot be set"
    if limits.matryoshka_dimensions and dimensions not in limits.matryoshka_dimensions:
        return f"This model only supports dimensions in {limits.matryoshka_dimensions}"
    if limits.hidden_size is not None and not 1 <= dimensions <= limits.hidden_size:
        return f"dimensions must be in [1, {limits.hidden_size}] (the model's hidden size)"
    return None
