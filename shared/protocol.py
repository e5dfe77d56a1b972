"""Every message that crosses a process boundary, and its msgpack codec.

Each message is a slots dataclass with a `TAG`; on the wire it is a msgpack map
`{"v": SCHEMA_VERSION, "t": TAG, **fields}` stored under the field `d` of a stream entry.
Decoding checks the version and the tag and builds the dataclass from known fields only, so a
newer producer's extra fields are ignored and garbage raises `DecodeError` (never anything else).
Nothing is ever unpickled.

Sampling options travel as a `Sampling` map: typed for every producer and reader (a TypedDict, checked
by mypy), with the engine's `SamplingParams` field names, and a map rather than a struct because an
absent field means something: the model's generation defaults fill only what a request left out. The
engine validates the values; the wire stays free of engine imports.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypedDict, TypeVar

import msgpack

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class Sampling(TypedDict, total=False):
    """A request's sampling options as the services pass them on; every key is optional."""

    # the engine's SamplingParams fields (services/engine/sampling_params.py)
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[str, float]  # token id (as a string: a JSON object's key) -> bias
    seed: int | None
    logprobs: int | None
    max_tokens: int | None  # set by the tokenizer: the resolved budget
    min_tokens: int
    min_characters: int
    stop_token_ids: list[int]
    ignore_eos: bool
    prompt_logprobs: int | None
    structured_output: dict[str, Any] | None  # GrammarSpec.to_wire()
    priority: int
    allowed_token_ids: list[int] | None
    bad_words_token_ids: list[list[int]] | None  # set by the tokenizer from bad_words
    cache_salt: str | None
    reasoning_start_ids: list[list[int]] | None  # set by the tokenizer from reasoning_markers
    reasoning_end_ids: list[list[int]] | None  # the grammar applies once the output completes one of these
    # the tokenizer's own, taken off before the engine sees the request
    bad_words: list[str]
    truncate_prompt_tokens: int
    truncation_side: Literal["left", "right"]
    prompt_cache_key: str
    reasoning_markers: dict[str, list[str]]  # {"starts", "ends"}: the reasoning parser's markers, as text


TOKENIZER_ONLY_SAMPLING = frozenset(
    {"bad_words", "truncate_prompt_tokens", "truncation_side", "prompt_cache_key", "reasoning_markers"}
)


class DecodeError(ValueError):
    """A stream entry that is not a message of this schema."""


@dataclass(slots=True)
class ChatRequest:
    TAG: ClassVar[str] = "chat"
    request_id: str
    reply_to: str  # the gateway id whose response stream gets the replies
    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling = field(default_factory=lambda: Sampling())
    max_tokens: int | None = None  # None = the context that is left
    stream: bool = False
    arrival_time: float = 0.0
    traceparent: str | None = None  # W3C trace context of the request's span
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # for the chat template (HF's `tools=`)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    documents: list[dict[str, Any]] | None = None  # for the chat template (HF's `documents=`)
    lora_name: str | None = None  # the LoRA adapter the request's `model` named (`model` is then its base)


@dataclass(slots=True)
class CompletionRequest:
    TAG: ClassVar[str] = "completion"
    request_id: str
    reply_to: str
    model: str
    prompt: str | list[int]
    sampling: Sampling = field(default_factory=lambda: Sampling())
    max_tokens: int | None = None
    stream: bool = False
    arrival_time: float = 0.0
    traceparent: str | None = None
    # /v1/embeddings: the prompt is pooled, not continued: {"dimensions": int | None} (None: generate)
    pooling: dict[str, Any] | None = None
    lora_name: str | None = None  # as ChatRequest's


@dataclass(slots=True)
class GenerateRequest:
    TAG: ClassVar[str] = "generate"
    request_id: str
    reply_to: str
    model: str
    prompt_token_ids: list[int]
    sampling: Sampling  # includes the resolved max_tokens and stop_token_ids
    arrival_time: float = 0.0
    traceparent: str | None = None
    # A continuation (migration to another replica) carries the tokens already streamed.
    output_token_ids: list[int] = field(default_factory=list)
    # An n > 1 continuation instead carries, per choice still running, its original index and the tokens
    # it already streamed (choices that finished are not resumed; the replies keep these indexes).
    choice_indexes: list[int] = field(default_factory=list)
    choice_output_token_ids: list[list[int]] = field(default_factory=list)
    pooling: dict[str, Any] | None = None  # an embedding request (CompletionRequest.pooling); only a pooling engine
    lora_name: str | None = None  # run with this LoRA adapter (None: the base model)


@dataclass(slots=True)
class Accepted:
    TAG: ClassVar[str] = "accepted"
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestError:
    TAG: ClassVar[str] = "error"
    request_id: str
    status: int  # the HTTP status the gateway answers with
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


@dataclass(slots=True)
class TokenDeltas:
    """One engine step's new tokens for every request of one gateway, as columns."""

    TAG: ClassVar[str] = "deltas"
    engine_id: str
    step: int
    request_ids: list[str]
    indexes: list[int]  # choice index (n > 1)
    token_ids: list[list[int]]
    # Per request: None, or per new token [logprob, [[token_id, logprob], ...top alternatives]].
    logprobs: list[list[Any] | None]
    finish_reasons: list[str | None]
    num_prompt_tokens: list[int]
    num_output_tokens: list[int]  # this choice's total so far
    num_cached_tokens: list[int]
    # Per request: None, or (with its first token, when asked) per prompt token None (the first) or
    # [logprob, [[token_id, logprob], ...top]]. May be empty from an engine that predates it.
    prompt_logprobs: list[list[Any] | None] = field(default_factory=list)
    # Per request: None, or a pooling request's embedding (float32 values), with its finish. May be empty.
    embeddings: list[list[float] | None] = field(default_factory=list)


@dataclass(slots=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    request_ids: list[str]
    reason: str = "abort"
    # Empty: end every choice of these requests. Otherwise only these choice indexes (a stop string
    # ended one choice of an n > 1 request); sent only to engines whose heartbeat says they can.
    choice_indexes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class LoRAUpdate:
    """Load or unload a LoRA adapter at run time, broadcast to every engine of the model on its control stream."""

    TAG: ClassVar[str] = "lora_update"
    update_id: str
    action: Literal["load", "unload"]
    lora_name: str
    lora_path: str = ""


@dataclass(slots=True)
class EngineHeartbeat:
    """The registry record an engine refreshes (a key with a TTL, not a stream entry)."""

    TAG: ClassVar[str] = "heartbeat"
    engine_id: str
    model: str
    max_model_len: int
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    is_draining: bool = False
    time: float = 0.0
    model_source: str | None = None  # what the engine loaded (a name or path); the gateway's tokenizer
    supports_choice_abort: bool = False  # honours Abort.choice_indexes
    num_requests_finished: int = 0  # since the engine started: shows how work spreads over replicas
    supports_choice_continuation: bool = False  # honours GenerateRequest.choice_indexes (n > 1 failover)
    block_size: int = 0  # KV block tokens; 0: publishes no KV events (a router routes it by load only)
    runner: str = "generate"  # "pooling": it serves embeddings only (--runner); "generate": text only
    max_lora_rank: int = 0  # 0: serves no LoRA adapters (--enable-lora off)
    lora_adapters: dict[str, str] = field(default_factory=dict)  # adapters it serves: name -> path
    lora_resident: list[str] = field(default_factory=list)  # those in its device slots now (the router prefers)
    lora_errors: dict[str, str] = field(default_factory=dict)  # LoRAUpdate id -> why that load failed (recent)


@dataclass(slots=True)
class KVEvents:
    """Prefix blocks an engine's cache gained and lost since its last KV event (shared/kv_blocks.py names
    them), and its load; sent after a step that changed either. `snapshot`: `stored` is everything it
    holds now, and replaces what a router knew of it."""

    TAG: ClassVar[str] = "kv_events"
    engine_id: str
    block_size: int
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    snapshot: bool = False
    # its load when it sent this (a router weighs replicas by it: fresher than the heartbeat)
    time: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    num_used_blocks: int = 0
    # the host-memory tier (--kv-offload-gb): blocks it gained and lost (all it holds, in a snapshot)
    host_stored: list[int] = field(default_factory=list)
    host_removed: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TokenizerHeartbeat:
    """The registry record a tokenizer refreshes: the gateway answers 503 at once for a model without one."""

    TAG: ClassVar[str] = "tokenizer_heartbeat"
    tokenizer_id: str
    model: str
    time: float = 0.0


Message = (
    ChatRequest
    | CompletionRequest
    | GenerateRequest
    | Accepted
    | RequestError
    | TokenDeltas
    | Abort
    | LoRAUpdate
    | EngineHeartbeat
    | TokenizerHeartbeat
    | KVEvents
)
_TYPES: dict[str, type[Any]] = {
    cls.TAG: cls
    for cls in (
        ChatRequest,
        CompletionRequest,
        GenerateRequest,
        Accepted,
        RequestError,
        TokenDeltas,
        Abort,
        LoRAUpdate,
        EngineHeartbeat,
        TokenizerHeartbeat,
        KVEvents,
    )
}
_FIELDS = {tag: {f.name for f in dataclasses.fields(cls)} for tag, cls in _TYPES.items()}
T = TypeVar("T")


def encode(msg: Message) -> bytes:
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return msgpack.packb({"v": SCHEMA_VERSION, "t": msg.TAG, **body}, use_bin_type=True)


def decode(data: bytes) -> Message:
    if not isinstance(data, bytes | bytearray) or len(data) > MAX_MESSAGE_BYTES:
        raise DecodeError("not a message: wrong type or too large")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise DecodeError(f"not msgpack: {exc}") from None
    if not isinstance(raw, dict) or raw.get("v") != SCHEMA_VERSION or raw.get("t") not in _TYPES:
        raise DecodeError("not a pagedserve message of this schema version")
    tag = raw["t"]
    known = {k: v for k, v in raw.items() if k in _FIELDS[tag]}
    try:
        message: Message = _TYPES[tag](**known)
        return message
    except TypeError as exc:
        raise DecodeError(f"bad {tag} message: {exc}") from None


def decode_as(data: bytes, cls: type[T]) -> T:
    msg = decode(data)
    if not isinstance(msg, cls):
        raise DecodeError(f"expected {cls.__name__}, got {type(msg).__name__}")
    return msg
