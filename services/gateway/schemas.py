"""Request bodies of the OpenAI API, validated strictly at the edge.

Unknown fields are rejected (as OpenAI does) rather than silently ignored; every error names the
offending parameter. `sampling_dict` maps a request onto the engine's SamplingParams fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.gateway.errors import APIError
from shared.settings import GatewaySettings

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class _SamplingFields(_Strict):
    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's completions default

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            if len(value) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value  # type: ignore[no-any-return]

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens


def parse(cls: type[_SamplingFields], body: Any, settings: GatewaySettings) -> Any:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"]]
        param = loc[0] if loc else None
        where = ".".join(loc)
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {where}", param=param) from None
        if first["type"] == "missing":
            raise APIError(400, f"Missing required parameter: '{where}'", param=param) from None
        raise APIError(400, f"Invalid value for '{where}': {first['msg']}", param=param) from None
    _check_limits(req, settings)
    return req


def _check_limits(req: Any, settings: GatewaySettings) -> None:
    if req.n > settings.max_n:
        raise APIError(400, f"n must be at most {settings.max_n}", param="n")
    if len(req.stop_strings) > settings.max_stop:
        raise APIError(400, f"at most {settings.max_stop} stop sequences are allowed", param="stop")
    if len(req.logit_bias or {}) > settings.max_logit_bias:
        raise APIError(400, f"logit_bias may have at most {settings.max_logit_bias} entries", param="logit_bias")
    if isinstance(req, ChatCompletionRequest):
        if len(req.messages) > settings.max_messages:
            raise APIError(400, f"at most {settings.max_messages} messages are allowed", param="messages")
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(
                400, f"response_format type '{req.response_format.type}' is not supported by this server",
                param="response_format",
            )
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream=true", param="stream_options")


def sampling_dict(req: Any) -> dict[str, Any]:
    """The engine's SamplingParams fields for this request (max_tokens is resolved by the tokenizer)."""
    fields: dict[str, Any] = {
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k in (None, -1) else req.top_k,
        "min_p": req.min_p or 0.0,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "repetition_penalty": req.repetition_penalty or 1.0,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "stop_token_ids": list(req.stop_token_ids or []),
        "logprobs": req.num_logprobs,
    }
    if req.seed is not None:
        fields["seed"] = req.seed
    if req.logit_bias:
        fields["logit_bias"] = dict(req.logit_bias)
    return fields
