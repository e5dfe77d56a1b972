"""Settings, one pydantic-settings class per service, each with its own environment prefix.

Each service builds its settings once in `main()` and passes them down; deep modules never read
the environment. `PAGEDSERVE_REDIS_URL` sets the Redis URL for every service at once.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_REDIS_URL = Field(
    default="redis://127.0.0.1:6379/0",
    validation_alias=AliasChoices("redis_url", "PAGEDSERVE_REDIS_URL"),
    description="Redis URL; PAGEDSERVE_REDIS_URL sets it for every service.",
)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDSERVE_GATEWAY_", populate_by_name=True)

    host: str = "0.0.0.0"
    port: int = 8000
    gateway_id: str = Field(default_factory=lambda: _new_id("gw"))
    redis_url: str = _REDIS_URL
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Bearer keys; empty = no auth (PAGEDSERVE_GATEWAY_API_KEYS: comma-separated)",
    )
    max_body_bytes: int = 4 * 1024 * 1024
    max_in_flight: int = 512
    request_timeout_s: float = 600.0
    accept_timeout_s: float = 30.0  # waiting for the tokenizer's Accepted/RequestError
    engine_silence_timeout_s: float = 60.0  # no delta and no live engine for this long = error
    registry_refresh_s: float = 1.0
    max_n: int = 16
    max_stop: int = 16
    max_logit_bias: int = 1024
    max_messages: int = 1024
    tool_call_parser: Literal["hermes", "llama3"] = "hermes"  # the model's tool-call format (auto)
    stream_maxlen: int = 100_000
    # Redis connections of this process: the response reader, the registry and pipelined publishes
    # need a few whatever the number of requests in flight.
    redis_max_connections: int = 16
    workers: int = 1  # gateway processes sharing the port (SO_REUSEPORT), each a whole gateway
    reuse_port: bool = False  # SO_REUSEPORT on the listening socket (workers set it)
    # Idle keep-alive connections stay open this long. Above clients' own idle expiry (httpx: 5 s), so a
    # client never reuses a connection the server is closing at that very moment (a reset, not a retry).
    keep_alive_s: int = 75
    drain_timeout_s: float = 30.0  # on SIGTERM: let requests in flight finish for at most this long
    max_prompts: int = 64  # prompts x n of one batched completion (each prompt is its own request)
    grpc_port: int = 0  # the gRPC front door's port; 0 = off

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        if isinstance(value, str):  # from the environment: "key1,key2"
            return [k.strip() for k in value.split(",") if k.strip()]
        return value


class TokenizerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDSERVE_TOKENIZER_", populate_by_name=True)

    model: str | None = None  # None = the default model
    served_model_name: str | None = None
    redis_url: str = _REDIS_URL
    consumer_name: str = Field(default_factory=lambda: _new_id("tok"))
    max_model_len: int | None = None
    claim_idle_ms: int = 30_000
    stream_maxlen: int = 100_000
    metrics_port: int = 0  # Prometheus /metrics on this port; 0 = off


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PAGEDSERVE_ENGINE_", populate_by_name=True)

    model: str | None = None
    served_model_name: str | None = None
    redis_url: str = _REDIS_URL
    engine_id: str = Field(default_factory=lambda: _new_id("eng"))
    device: str = "auto"  # auto = cuda when available
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights, activations and the KV cache
    cpu_threads: int | None = None  # torch intra-op threads; fewer avoids stalls when cores are shared
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    drain_timeout_s: float = 30.0  # on SIGTERM: finish what is running for at most this long
    claim_idle_ms: int = 15_000  # live engines refresh their claims every heartbeat
    stream_maxlen: int = 100_000
    load_format: str = "auto"  # "auto": the checkpoint's weights | "random": random weights (benchmarks)
    quantization: str | None = None  # "fp8": FP8 weights (quantised at load); None: fp8 only if the checkpoint is
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": e4m3 KV cache (twice the blocks)
    tensor_parallel_size: int = 1  # one replica as N processes, one GPU each (rank r on cuda:r)
    metrics_port: int = 0  # Prometheus /metrics on this port; 0 = off
