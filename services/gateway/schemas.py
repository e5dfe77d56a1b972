"""Request bodies of the OpenAI API, validated strictly at the edge.

Unknown fields are rejected (as OpenAI does) rather than silently ignored, types are not coerced,
and every error names the offending parameter (`messages[0].role`). Cross-field rules and the
operator's caps live in `check_limits`. `sampling_dict` maps a request onto the engine's
SamplingParams fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from services.gateway.errors import APIError
from services.gateway.messages import ChatMessage, Strict
from shared.prompts import check_template_kwargs
from shared.settings import GatewaySettings

MAX_INT32 = 2**31 - 1  # bounds counts and token ids so they always fit the wire (msgpack: 64 bits)
MAX_LOGPROBS = 20
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[int, Field(ge=1, le=MAX_INT32)]


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _SamplingFields(Strict):
    model: str = Field(min_length=1)
    n: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)  # 0 or -1: off
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    max_tokens: Count | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=MAX_INT32)
    ignore_eos: bool | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) <= MAX_INT32):
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.include_usage and self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[Any]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_tokens: Count | None = 16  # OpenAI's completions default

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: str | list[Any]) -> str | list[int]:
        """One prompt: a string or token ids (a batch of exactly one is unwrapped)."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str):
            return value
        if not value:
            raise ValueError("the prompt is empty")
        if any(isinstance(v, str | list) for v in value):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        if not all(type(v) is int and 0 <= v <= MAX_INT32 for v in value):
            raise ValueError("a token-id prompt must be a list of non-negative integers")
        return value

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens


def check_limits(req: ChatCompletionRequest | CompletionRequest, settings: GatewaySettings) -> None:
    """Cross-field rules and the operator's caps, after the schema itself validated."""
    if req.num_choices > settings.max_n:
        raise APIError(400, f"n must be at most {settings.max_n}", param="n")
    if len(req.stop_strings) > settings.max_stop:
        raise APIError(400, f"at most {settings.max_stop} stop sequences are allowed", param="stop")
    if len(req.stop_token_ids or []) > settings.max_stop:
        raise APIError(400, f"at most {settings.max_stop} stop_token_ids are allowed", param="stop_token_ids")
    if len(req.logit_bias or {}) > settings.max_logit_bias:
        raise APIError(400, f"logit_bias may have at most {settings.max_logit_bias} entries", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream=true", param="stream_options")
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req, settings)
    else:
        if req.best_of is not None and req.best_of != req.num_choices:
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo")


def _check_chat(req: ChatCompletionRequest, settings: GatewaySettings) -> None:
    if len(req.messages) > settings.max_messages:
        raise APIError(400, f"at most {settings.max_messages} messages are allowed", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(
            400, f"response_format type '{req.response_format.type}' is not supported by this server "
            "(no constrained decoding)", param="response_format",
        )
    try:
        check_template_kwargs(req.chat_template_kwargs or {})
    except ValueError as exc:
        raise APIError(400, str(exc), param="chat_template_kwargs") from None


def sampling_dict(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The engine's SamplingParams fields for this request (max_tokens is resolved by the tokenizer)."""
    fields: dict[str, Any] = {
        "n": req.num_choices,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k in (None, -1) else req.top_k,
        "min_p": req.min_p or 0.0,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": req.repetition_penalty or 1.0,
        "min_tokens": req.min_tokens or 0,
        "ignore_eos": bool(req.ignore_eos),
        "stop_token_ids": list(req.stop_token_ids or []),
        "logprobs": req.num_logprobs,
    }
    if req.seed is not None:
        fields["seed"] = req.seed
    if req.logit_bias:
        fields["logit_bias"] = dict(req.logit_bias)
    return fields
