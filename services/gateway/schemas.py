"""Request bodies of the OpenAI API, validated strictly at the edge.

Types are not coerced and every error names the offending parameter (`messages[0].role`). Unknown
fields are ignored and reported (or refused under `strict_request_fields`: validation.py); OpenAI
fields that have no meaning here (`store`, `metadata`, ...) are known, type-checked and unused.
Cross-field rules and the operator's caps live in `check_limits`. `sampling_dict` maps a request
onto the engine's SamplingParams fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pagedserve.services.gateway import structured
from pagedserve.services.gateway.detokenizer import TextOptions
from pagedserve.services.gateway.errors import APIError
from pagedserve.services.gateway.messages import ChatMessage, Strict
from pagedserve.shared.config import GatewayConfig
from pagedserve.shared.prompts import check_template_kwargs
from pagedserve.shared.protocol import Sampling

MAX_INT32 = 2**31 - 1  # bounds counts and token ids so they always fit the wire (msgpack: 64 bits)
MAX_LOGPROBS = 20
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
Count = Annotated[int, Field(ge=1, le=MAX_INT32)]


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")  # `json` is a BaseModel method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


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
    min_characters: int | None = Field(default=None, ge=0, le=MAX_INT32)  # EOS held off until the text is this long
    ignore_eos: bool | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's: top-k per prompt token
    request_id: str | None = Field(default=None, min_length=1, max_length=256)  # vLLM's: the response's id
    include_stop_str_in_output: bool = False  # vLLM's: the text keeps the stop string that ended it
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text
    spaces_between_special_tokens: bool = True  # vLLM's: accepted; the streaming decoder adds no spaces
    return_token_ids: bool = False  # vLLM's: prompt and output token ids on each choice (streamed too)
    priority: int = Field(default=0, ge=-MAX_INT32, le=MAX_INT32)  # vLLM's: lower first (--scheduling-policy priority)
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)  # vLLM's: only these are sampled
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None  # vLLM's: never generated
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: prefix-cache isolation per tenant
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=MAX_INT32)  # vLLM's: keep k prompt tokens
    truncation_side: Literal["left", "right"] = "left"  # which end truncate_prompt_tokens cuts
    use_beam_search: bool = False  # vLLM's: the n best of n (or best_of) beams, best first (beam_search.py)
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0)  # vLLM's: score = logprob / length ** this
    # vLLM's disaggregation and plugin hooks: accepted (not reported as ignored); nothing here reads them.
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # Constrained decoding, vLLM's extras (response_format is chat's, below).
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

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
    def beam_width(self) -> int:
        best_of = getattr(self, "best_of", None)
        return max(self.num_choices, best_of or 0)

    @property
    def text_options(self) -> TextOptions:
        return TextOptions(self.include_stop_str_in_output, self.skip_special_tokens)

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
    # vLLM's chat-template extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    echo: bool = False  # vLLM's: the answer starts with the last message when it is the assistant's
    documents: list[dict[str, str]] | None = None  # for RAG templates that take them
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's legacy function calling: mapped onto tools / tool_choice, answered in the legacy shape.
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | FunctionName | None = None
    # OpenAI fields accepted and unused: storage, billing, caching hints and other modalities do not apply.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # routes a conversation's requests to one replica (prefix_router.py)
    safety_identifier: str | None = None
    reasoning_effort: str | None = None  # reaches templates that take it (as a chat_template_kwargs key)
    verbosity: str | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @model_validator(mode="after")
    def _legacy_functions_as_tools(self) -> ChatCompletionRequest:
        if self.functions is None and self.function_call is None:
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("functions/function_call: give either them or tools/tool_choice, not both")
        if self.functions:
            self.tools = [Tool(type="function", function=f) for f in self.functions]
        call = self.function_call
        self.tool_choice = NamedToolChoice(type="function", function=call) if isinstance(call, FunctionName) else call
        return self

    @property
    def echo_text(self) -> str:
        """vLLM's chat `echo`: the last message's text when the answer continues the same (assistant) role."""
        last = self.messages[-1]
        return str(last.as_template_input()["content"]) if self.echo and last.role == "assistant" else ""

    @property
    def uses_legacy_functions(self) -> bool:
        """The request called with `functions`: the answer carries `message.function_call` (one call)."""
        return self.functions is not None

    @field_validator("continue_final_message")
    @classmethod
    def _one_prompt_ending(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError("set add_generation_prompt to false with continue_final_message (vLLM's rule)")
        messages = info.data.get("messages") or []
        if value and messages and messages[-1].role != "assistant":
            raise ValueError("the last message must be the assistant's to continue it")
        return value


class CompletionRequest(_SamplingFields):
    prompt: str | list[Any]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_tokens: Count | None = 16  # OpenAI's completions default
    suffix: str | None = None  # accepted by the schema only to be refused clearly (check_limits)

    @field_validator("prompt")
    @classmethod
    def _prompt_or_batch(cls, value: str | list[Any]) -> str | list[Any]:
        """A string, token ids, or a batch of either (a batch of exactly one is unwrapped)."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str):
            return value
        if not value:
            raise ValueError("the prompt is empty")
        if all(isinstance(v, str) for v in value):
            return value
        if all(isinstance(v, list) for v in value):
            return [_token_ids(v) for v in value]
        if any(isinstance(v, str | list) for v in value):
            raise ValueError("a batch must be all strings or all token-id lists")
        return _token_ids(value)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of a batch, or the one prompt."""
        if isinstance(self.prompt, str) or all(type(v) is int for v in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens


def _token_ids(value: list[Any]) -> list[int]:
    if not value:
        raise ValueError("a prompt in the batch is empty")
    if not all(type(v) is int and 0 <= v <= MAX_INT32 for v in value):
        raise ValueError("a token-id prompt must be a list of non-negative integers")
    return value


def check_limits(req: ChatCompletionRequest | CompletionRequest, settings: GatewayConfig) -> None:
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
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not available when stream=true", param="prompt_logprobs")
    structured.check_grammar(req)  # 400 naming the field before anything is sent
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req, settings)
    else:
        if req.best_of is not None and req.best_of < req.num_choices:
            raise APIError(400, "best_of must be at least n", param="best_of")
        if req.best_of is not None and req.best_of != req.num_choices and not req.use_beam_search:
            raise APIError(400, "best_of other than n is supported with use_beam_search only", param="best_of")
        if req.suffix is not None:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported by this server", param="suffix")
        if len(req.prompts) * req.num_choices > settings.max_prompts:
            raise APIError(400, f"a batch may have at most {settings.max_prompts} prompts x n", param="prompt")


def _check_chat(req: ChatCompletionRequest, settings: GatewayConfig) -> None:
    if len(req.messages) > settings.max_messages:
        raise APIError(400, f"at most {settings.max_messages} messages are allowed", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    try:
        check_template_kwargs(req.chat_template_kwargs or {})
    except ValueError as exc:
        raise APIError(400, str(exc), param="chat_template_kwargs") from None


def sampling_dict(req: ChatCompletionRequest | CompletionRequest) -> Sampling:
    """The engine's SamplingParams fields for this request (max_tokens is resolved by the tokenizer)."""
    fields = Sampling(
        n=req.num_choices,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        min_tokens=req.min_tokens or 0,
        ignore_eos=bool(req.ignore_eos),
        stop_token_ids=list(req.stop_token_ids or []),
        logprobs=req.num_logprobs,
    )
    # Left out when unset: the model's generation_config.json may default them (shared/generation_defaults.py);
    # else the engine's SamplingParams defaults (1, 1, off, off, 1) apply.
    if req.temperature is not None:
        fields["temperature"] = req.temperature
    if req.top_p is not None:
        fields["top_p"] = req.top_p
    if req.top_k is not None:
        fields["top_k"] = 0 if req.top_k == -1 else req.top_k  # -1 and 0 both mean off
    if req.min_p is not None:
        fields["min_p"] = req.min_p
    if req.repetition_penalty is not None:
        fields["repetition_penalty"] = req.repetition_penalty
    if req.seed is not None:
        fields["seed"] = req.seed
    prompt_logprobs = max(req.prompt_logprobs if req.prompt_logprobs is not None else -1, _echo_logprobs(req))
    if prompt_logprobs >= 0:  # only then: an engine that predates the field still takes other requests
        fields["prompt_logprobs"] = prompt_logprobs
    if req.logit_bias:
        fields["logit_bias"] = dict(req.logit_bias)
    if req.priority:  # only then, like prompt_logprobs
        fields["priority"] = req.priority
    if req.min_characters:  # only then, like priority
        fields["min_characters"] = req.min_characters
    cache_key = getattr(req, "prompt_cache_key", None)  # OpenAI's (chat): a routing hint for the tokenizer
    if cache_key:
        fields["prompt_cache_key"] = cache_key
    if req.allowed_token_ids is not None:
        fields["allowed_token_ids"] = req.allowed_token_ids
    if req.bad_words is not None:  # the tokenizer turns them into token ids
        fields["bad_words"] = req.bad_words
    if req.cache_salt is not None:
        fields["cache_salt"] = req.cache_salt
    if req.truncate_prompt_tokens is not None:  # the tokenizer's, taken off before the engine sees the request
        fields["truncate_prompt_tokens"] = req.truncate_prompt_tokens
        fields["truncation_side"] = req.truncation_side
    grammar = structured.grammar_spec(req)
    if grammar is not None:
        fields["structured_output"] = grammar[0].to_wire()
    return fields


def _echo_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int:
    """Completions with echo and logprobs report the prompt tokens' logprobs too (-1: no)."""
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        return req.logprobs
    return -1
