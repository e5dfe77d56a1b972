"""Turns a chat or completion request into prompt token ids, with the length checks (no Redis here)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.services.tokenizer.embeddings import process_embedding
from pagedserve.shared.prompts import chat_prompt_ids, check_template_kwargs, first_out_of_vocab, text_prompt_ids
from pagedserve.shared.protocol import Accepted, ChatRequest, CompletionRequest, GenerateRequest, RequestError, Sampling


@dataclass(slots=True)
class ModelLimits:
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int | None = None  # the model's (embedding rows), for stop_token_ids / logit_bias
    hidden_size: int | None = None  # an embedding's size (embeddings.py checks `dimensions` against it)
    is_matryoshka: bool = False  # config.json allows truncated embeddings (`dimensions`)
    matryoshka_dimensions: list[int] | None = None  # ... of these sizes only, when it lists them


def read_limits(model_dir: Path, max_model_len: int | None) -> ModelLimits:
    """Context length and EOS ids from config.json and generation_config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    native = int(
        text_config.get("max_position_embeddings")
        or text_config.get("n_positions")
        or text_config.get("seq_length")
        or 2048
    )
    if max_model_len is not None and max_model_len > native:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's context of {native} tokens")
    eos: Any = None
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = text_config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    vocab = text_config.get("vocab_size")
    hidden = text_config.get("hidden_size")
    matryoshka = text_config.get("matryoshka_dimensions")
    return ModelLimits(
        max_model_len=max_model_len or native,
        eos_token_ids=eos_ids,
        vocab_size=int(vocab) if vocab else None,
        hidden_size=int(hidden) if hidden else None,
        is_matryoshka=bool(text_config.get("is_matryoshka") or matryoshka),
        matryoshka_dimensions=[int(d) for d in matryoshka] if matryoshka else None,
    )


class PromptProcessor:
    def __init__(self, tokenizer: Any, limits: ModelLimits, default_max_tokens: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.default_max_tokens = default_max_tokens  # generation_config.json's max_new_tokens (--generation-config)
        self.served_limit: int | None = None  # the smallest context the model's live engines serve (service.py)

    @property
    def context_limit(self) -> int:
        """What a request is checked against: the model's limit, lowered to what its live engines serve, so
        an over-long prompt gets its 400 here, before any header goes out, not an error from an engine."""
        own = self.limits.max_model_len
        return own if self.served_limit is None else min(own, self.served_limit)

    def prompt_ids(self, req: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            return chat_prompt_ids(
                self.tokenizer,
                req.messages,
                req.chat_template_kwargs,
                req.add_generation_prompt,
                req.tools,
                req.continue_final_message,
                req.documents,
            )
        return text_prompt_ids(self.tokenizer, req.prompt)

    def process(self, req: ChatRequest | CompletionRequest) -> tuple[Accepted, GenerateRequest] | RequestError:
        if isinstance(req, CompletionRequest) and req.pooling is not None:
            return process_embedding(self.tokenizer, self.limits, self.context_limit, req, self._truncated)
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        if isinstance(req, ChatRequest):
            try:
                check_template_kwargs(req.chat_template_kwargs, self.tokenizer)
            except ValueError as exc:
                return RequestError(req.request_id, 400, str(exc), param="chat_template_kwargs")
        try:
            prompt_ids = self.prompt_ids(req)
        except Exception as exc:  # template errors come from user content: answer 400, keep serving
            return RequestError(req.request_id, 400, f"could not build the prompt: {exc}", param=param)
        prompt_ids = self._truncated(prompt_ids, req.sampling)
        vocab = len(self.tokenizer)
        if not prompt_ids:
            return RequestError(req.request_id, 400, "the prompt is empty", param=param)
        if first_out_of_vocab(prompt_ids, vocab) is not None:
            return RequestError(req.request_id, 400, f"prompt token ids must be in [0, {vocab})", param=param)
        num_prompt, limit = len(prompt_ids), self.context_limit
        if req.max_tokens is None:
            if num_prompt >= limit:
                return _too_long(req.request_id, num_prompt, limit, param)
            max_tokens = limit - num_prompt
            if self.default_max_tokens is not None:
                max_tokens = min(max_tokens, self.default_max_tokens)
        else:
            max_tokens = req.max_tokens
            if num_prompt + max_tokens > limit:
                return RequestError(
                    req.request_id,
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                    f"completion). Please reduce the prompt or max_tokens.",
                    param="max_tokens" if num_prompt < limit else param,
                    code="context_length_exceeded",
                )
        min_tokens = int(req.sampling.get("min_tokens", 0) or 0)
        if min_tokens > max_tokens:
            return RequestError(
                req.request_id,
                400,
                f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})",
                param="min_tokens",
            )
        bad_ids = self._check_token_ids(req)
        if bad_ids is not None:
            return bad_ids
        sampling = self._engine_sampling(req.sampling)
        sampling["max_tokens"] = max_tokens
        accepted = Accepted(req.request_id, num_prompt, max_tokens, prompt_token_ids=prompt_ids)
        generate = GenerateRequest(
            request_id=req.request_id,
            reply_to=req.reply_to,
            model=req.model,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            arrival_time=req.arrival_time,
            traceparent=req.traceparent,
            lora_name=req.lora_name,
        )
        return accepted, generate

    def _truncated(self, prompt_ids: list[int], sampling: Sampling) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep that many prompt tokens (-1: the context's worth), cut from the
        left by default (the end of a long prompt matters most), before the context check."""
        keep = sampling.get("truncate_prompt_tokens")
        if keep is None:
            return prompt_ids
        keep = self.context_limit if keep == -1 else keep
        if len(prompt_ids) <= keep:
            return prompt_ids
        return prompt_ids[:keep] if sampling.get("truncation_side") == "right" else prompt_ids[len(prompt_ids) - keep :]

    def _engine_sampling(self, sampling: Sampling) -> Sampling:
        """The engine's sampling fields: `bad_words` (text) becomes `bad_words_token_ids`; the tokenizer's own
        fields (protocol.TOKENIZER_ONLY_SAMPLING) are dropped."""
        engine = sampling.copy()
        bad_words = engine.pop("bad_words", None)
        engine.pop("truncate_prompt_tokens", None)
        engine.pop("truncation_side", None)
        engine.pop("prompt_cache_key", None)
        markers = engine.pop("reasoning_markers", None)
        if bad_words:
            engine["bad_words_token_ids"] = bad_word_token_ids(self.tokenizer, bad_words)
        if markers:
            engine["reasoning_start_ids"] = marker_token_ids(self.tokenizer, markers.get("starts", []))
            engine["reasoning_end_ids"] = marker_token_ids(self.tokenizer, markers.get("ends", []))
        return engine

    def _check_token_ids(self, req: ChatRequest | CompletionRequest) -> RequestError | None:
        """stop_token_ids and logit_bias keys must be token ids of this model (checked before any SSE byte)."""
        vocab = self.limits.vocab_size or len(self.tokenizer)
        sampling = req.sampling
        given = {
            "stop_token_ids": sampling.get("stop_token_ids"),
            "logit_bias": sampling.get("logit_bias"),  # its keys
            "allowed_token_ids": sampling.get("allowed_token_ids"),
        }
        for param, values in given.items():
            try:
                ids = [int(t) for t in values or []]
            except (TypeError, ValueError):
                return RequestError(req.request_id, 400, f"{param}: token ids must be integers", param=param)
            bad = first_out_of_vocab(ids, vocab)
            if bad is not None:
                return RequestError(req.request_id, 400, f"{param}: token id {bad} is not in [0, {vocab})", param=param)
        return None


def bad_word_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each word's tokens as it would start the text and as it would follow a space (vLLM's rule), without
    duplicates: a model may write either form."""
    found: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in found:
                found.append(ids)
    return found


def marker_token_ids(tokenizer: Any, markers: list[str]) -> list[list[int]]:
    """Each marker's tokens as the model writes it (a special token such as </think> is one id)."""
    return [ids for marker in markers if (ids := list(tokenizer.encode(marker, add_special_tokens=False)))]


def _too_long(request_id: str, num_prompt: int, limit: int, param: str) -> RequestError:
    return RequestError(
        request_id,
        400,
        f"This model's maximum context length is {limit} tokens. However, your prompt has {num_prompt} "
        f"tokens, which leaves no room for the completion. Please reduce the length of the prompt.",
        param=param,
        code="context_length_exceeded",
    )
