"""The one configuration tree: a section per concern, each field with one home, one default and one help line.

    Config
    ├── model          what to serve: checkpoint, dtype, context length, weights, template, defaults
    ├── cache          the paged KV cache: block size, memory share, dtype, prefix caching
    ├── scheduler      batch limits: sequences, tokens per step, waiting queue
    ├── runner         how steps run: CUDA graphs, warm-up, async scheduling
    ├── parallel       devices: device, tensor parallelism, GPUs for `serve`, CPU threads
    ├── lora           LoRA adapters: which to serve, slots, rank limit, runtime loading
    ├── engine         the engine service: id, heartbeats, drain, claims, metrics port
    ├── tokenizer      the tokenizer service: id, claims, metrics port
    ├── gateway        HTTP/gRPC front door: address, keys, limits, parsers, workers
    ├── routing        Redis and its streams
    └── observability  logs
`pagedserve.shared.config_cli` parses it once (flags > PAGEDSERVE_* env > --config file > defaults) and hands it
whole, as JSON, to every child process. Stdlib dataclasses only: the engine core imports this on a bare GPU box
(torch, triton, transformers, safetensors) with no pydantic.

Every field is a flag named after it (`--max-model-len`); a name used by two sections takes the section as prefix
(`--engine-drain-timeout-s`, `--tokenizer-metrics-port`). Its environment variable is PAGEDSERVE_ + the flag's
name in upper case (PAGEDSERVE_MAX_MODEL_LEN).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}
LOAD_FORMATS = {"auto": "auto", "safetensors": "auto", "gguf": "auto", "dummy": "random", "random": "random"}
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}
QUANTIZATIONS = ("fp8", "awq", "gptq", "compressed-tensors", "mxfp4")
# vLLM's --tool-call-parser names (services/gateway/tool_parsers/ reads each; `llama3` is our older llama3_json)
TOOL_CALL_PARSERS = (
    "hermes",
    "llama3_json",
    "llama3",
    "pythonic",
    "llama4_pythonic",
    "mistral",
    "qwen3_coder",
    "deepseek_v3",
    "deepseek_v31",
    "granite",
    "phi4_mini_json",
    "glm45",
    "kimi_k2",
    "openai",
)
REASONING_PARSERS = ("deepseek_r1", "qwen3", "mistral", "granite", "gpt_oss", "openai")
RUNNERS = ("auto", "generate", "pooling")
MAX_LORA_RANK = 64  # the kernels' largest rank tile


def opt(default: Any, help: str, **meta: Any) -> Any:
    """A config field: its default, its --help line and flag metadata (choices, aliases, short, repeatable)."""
    return field(default=default, metadata={"help": help, **meta})


def _pick(name: str, value: Any, table: dict[str, str]) -> Any:
    if value not in table:
        raise ValueError(f"{name}: unknown {value!r} (expected one of {', '.join(table)})")
    return table[value]


def _at_least(section: Any, minimum: float, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < minimum:
            raise ValueError(f"{name}: must be >= {minimum}")


@dataclass(slots=True)
class ModelConfig:
    model: str | None = opt(
        None,
        "model name, HF directory, .gguf file or cached hub id (default: "
        "SmolLM2-135M-Instruct; serve: repeat to serve several)",
        repeatable=True,
    )
    served_model_name: str | None = opt(None, "the name clients use (default: the model's name)")
    dtype: str = opt(
        "auto",
        "weights and activations: auto (fp32 on CPU, 16-bit on CUDA), float32, bfloat16, "
        "float16 (vLLM's half/float also accepted)",
        choices=tuple(DTYPES),
    )
    max_model_len: int | None = opt(None, "context length served (default: the model's, capped by the KV cache)")
    load_format: str = opt(
        "auto",
        "auto|safetensors|gguf: the checkpoint's weights; dummy (or random): random weights of the model's shape",
        choices=tuple(LOAD_FORMATS),
    )
    quantization: str | None = opt(
        None,
        "fp8: FP8 weights quantized at load; awq/gptq/compressed-tensors/mxfp4: the checkpoint's method "
        "(default: as the checkpoint is)",
        choices=QUANTIZATIONS,
        short="-q",
    )
    tokenizer: str | None = opt(None, "a tokenizer directory or name other than the model's own")
    seed: int = opt(0, "seed of random weights and of requests without their own seed")
    chat_template: str | None = opt(None, "a Jinja chat template, or a file holding one (default: the tokenizer's)")
    runner: str = opt(
        "auto",
        "generate: text generation; pooling: embeddings only (/v1/embeddings); auto: pooling for a "
        "sentence-transformers checkpoint (modules.json with a Pooling module), else generate",
        choices=RUNNERS,
    )
    pooler_config: str | None = opt(
        None,
        'pooling runner: JSON {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true} over what the '
        "checkpoint says (default LAST, normalized)",
        aliases=("--override-pooler-config",),
    )
    generation_config: str = opt(
        "auto",
        "auto: the checkpoint's generation_config.json gives defaults for omitted "
        "sampling fields; vllm: none (our defaults); or a folder holding one",
    )

    def __post_init__(self) -> None:
        self.dtype = _pick("dtype", self.dtype, DTYPES)
        self.load_format = _pick("load_format", self.load_format, LOAD_FORMATS)
        if self.quantization in ("none", ""):
            self.quantization = None
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: unsupported {self.quantization!r} (supported: {', '.join(QUANTIZATIONS)})")
        _at_least(self, 1, "max_model_len")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner: unknown {self.runner!r} (expected one of {', '.join(RUNNERS)})")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = opt(16, "tokens per KV cache block")
    gpu_memory_utilization: float = opt(0.9, "share of GPU memory for weights, activations and the KV cache")
    num_kv_blocks: int | None = opt(
        None,
        "KV cache blocks (default: CPU a fixed budget, CUDA from --gpu-memory-utilization)",
        aliases=("--num-gpu-blocks-override",),
    )
    cpu_kv_cache_bytes: int = opt(1 << 30, "KV cache bytes on CPU when --num-kv-blocks is not given")
    kv_cache_dtype: str = opt(
        "auto", "auto: the model's dtype; fp8 (fp8_e4m3): e4m3 with per-layer scales", choices=tuple(KV_CACHE_DTYPES)
    )
    enable_prefix_caching: bool = opt(True, "reuse cached KV blocks of shared prompt prefixes")
    kv_offload_gb: float = opt(
        0.0,
        "host memory (GiB) for a second KV tier: prefix blocks evicted from the device cache are kept there and "
        "copied back on a later hit instead of recomputed (0: off)",
        aliases=("--kv-offloading-size",),  # vLLM's name (GiB)
    )
    disable_hybrid_kv_cache_manager: bool = opt(
        False,
        "one block table for every layer of a model with global and sliding-window layers (Gemma, gpt-oss), "
        "instead of blocks of their own for the sliding layers, freed once out of the window (as vLLM)",
    )

    def __post_init__(self) -> None:
        self.kv_cache_dtype = _pick("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _at_least(self, 1, "block_size", "num_kv_blocks")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")
        if self.kv_offload_gb < 0:
            raise ValueError("kv_offload_gb: must be >= 0")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = opt(256, "sequences in one batch")
    max_num_batched_tokens: int = opt(2048, "tokens scheduled in one step (prefill chunks share it)")
    max_num_waiting: int | None = opt(
        None, "an engine takes no new work beyond this many waiting (default: max_num_seqs // 4, at least 8)"
    )
    watermark_fraction: float = opt(0.01, "share of KV blocks an engine keeps free before taking new work")
    scheduling_policy: str = opt(
        "fcfs",
        "fcfs: arrival order; priority: a request's `priority` (lower first), then "
        "arrival, for admission and (reversed) preemption",
        choices=("fcfs", "priority"),
    )

    def __post_init__(self) -> None:
        _at_least(self, 1, "max_num_seqs", "max_num_batched_tokens")

    @property
    def num_max_waiting(self) -> int:
        return self.max_num_waiting if self.max_num_waiting is not None else max(8, self.max_num_seqs // 4)


@dataclass(slots=True)
class RunnerConfig:
    enforce_eager: bool = opt(False, "never replay CUDA graphs (every step runs eagerly)")
    cuda_graph_max_batch: int = opt(512, "CUDA: decode steps of up to this many sequences replay captured graphs")
    cuda_graph_max_tokens: int = opt(
        2048,
        "CUDA: mixed and prefill steps of up to this many tokens (capped by max_num_batched_tokens) replay "
        "captured graphs; 0: decode graphs only",
    )
    async_scheduling: bool | None = opt(
        None, "schedule step N+1 before step N's tokens reach the host (default: on CUDA only)"
    )
    grammar_processes: int = opt(
        0,
        "structured output: the grammar matchers and their masks in this many processes of their own, which share "
        "the rows, off the engine thread's GIL (0: on a worker thread of the engine; one process on an H200 was no "
        "faster: bench/results/grammar_process_h200_2026-11-29)",
    )
    gemv_max_rows: int = opt(
        1,
        "CUDA: dense linears of up to this many rows (decode of a few sequences) run the GEMV kernel instead of "
        "cuBLAS (0-4; 0: cuBLAS always). Rows 2-4 measured slower than cuBLAS on the 8B linears (H200)",
    )
    pdl: bool = opt(
        True,
        "CUDA sm_90+: launch the decode step's Triton kernels with programmatic dependent launch, so each "
        "starts (and streams its first weights) while the one before ends",
    )
    warm_up: bool = opt(True, "CUDA: compile kernels and capture graphs at start-up")
    profile_steps: bool = opt(False, "time each step's phases (Engine.profile)")
    speculative_config: str | None = opt(
        None,
        'speculative decoding, as JSON (vLLM\'s form): {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": 4} or {"method": "eagle3", "model": EAGLE3_HEAD_DIR, "num_speculative_tokens": 3}; '
        "steps then run without overlap (no async scheduling)",
    )

    def __post_init__(self) -> None:
        _at_least(self, 0, "cuda_graph_max_batch")
        _at_least(self, 0, "cuda_graph_max_tokens", "grammar_processes")
        if not 0 <= self.gemv_max_rows <= 4:  # kernels/gemv.MAX_ROWS (shared/ imports no kernels)
            raise ValueError(f"gemv_max_rows: {self.gemv_max_rows} is not in 0-4")
        if self.speculative_config is not None:
            parse_speculative_config(self.speculative_config)  # a bad config stops start-up, naming the field

    @property
    def num_graph_batch(self) -> int:
        """The largest batch that replays a graph; 0 = eager always."""
        return 0 if self.enforce_eager else self.cuda_graph_max_batch

    @property
    def num_graph_tokens(self) -> int:
        """The largest mixed/prefill step that replays a graph; 0 = such steps run eagerly."""
        return 0 if self.enforce_eager else self.cuda_graph_max_tokens

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else parse_speculative_config(self.speculative_config)


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """The parsed `--speculative-config` (vLLM's keys; those we have no use for are refused, not ignored)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up in the context
    prompt_lookup_min: int = 1  # ngram: the shortest (vLLM's default when only max is given)
    model: str | None = None  # draft_model: its checkpoint (sharing the target's tokenizer); eagle3: the head's


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """Parse and check the JSON; ValueError naming `speculative_config.<key>` on anything wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("speculative_config: expected a JSON object")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    for key in data:
        if key not in known:
            raise ValueError(f"speculative_config.{key}: unknown key (known: {', '.join(sorted(known))})")
    method = data.get("method")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config.method: {method!r} is not one of {', '.join(SPECULATIVE_METHODS)}")
    for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
        value = data.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config.{key}: must be an integer >= 1 (got {value!r})")
    if "num_speculative_tokens" not in data:
        raise ValueError("speculative_config.num_speculative_tokens: required")
    if method == "ngram":
        lookup_max = data.get("prompt_lookup_max", 4)
        lookup_min = data.get("prompt_lookup_min", min(lookup_max, 1))
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min: {lookup_min} exceeds prompt_lookup_max")
        if "model" in data:
            raise ValueError("speculative_config.model: the ngram method takes no model")
        return SpeculativeConfig("ngram", data["num_speculative_tokens"], lookup_max, lookup_min)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"speculative_config.model: {method} needs the draft checkpoint's path")
    return SpeculativeConfig(method, data["num_speculative_tokens"], model=model)


@dataclass(slots=True)
class ParallelConfig:
    device: str = opt("auto", "auto (cuda when available), cpu, cuda or cuda:N")
    tensor_parallel_size: int = opt(1, "GPUs (processes) per engine replica", short="-tp")
    parallel_timeout_s: float = opt(120.0, "a collective waiting longer than this fails (a rank died)")
    disable_custom_all_reduce: bool = opt(
        False,
        "tensor parallel on CUDA: every all-reduce through NCCL (no symmetric-memory all-reduce for small ones, "
        "no fused all-reduce + RMSNorm)",
    )
    custom_all_reduce_max_bytes: int = opt(
        0,
        "tensor parallel on CUDA: all-reduces up to this size go over symmetric memory (torch's one/two-shot "
        "kernels), larger ones NCCL; 0 (the default): NCCL, since on 2 H100s (NVLink) it measured slower end to end "
        "(8B TP=2 ITL 4.45 vs 4.33 ms). Llama-family o/down outputs take --fused-all-reduce-max-bytes instead",
    )
    fused_all_reduce_max_bytes: int = opt(
        8 << 20,
        "tensor parallel on CUDA, Llama-family layers: the o/down projections write their partial sums into "
        "symmetric memory and one kernel sums them inside the next residual add + RMSNorm, up to this size "
        "(8B TP=2 ITL 3.31 vs 3.63 ms with NCCL on 2 H200s); 0: NCCL, then the norm",
    )
    fused_all_reduce_push: bool = opt(
        False,
        "the fused all-reduce's push protocol: each rank stores its partial into its peers' buffers and polls its "
        "own, instead of meeting them at a flag barrier and reading theirs (2 H200s: 4.53 vs 4.87 us at 1 row, "
        "18.2 vs 12.1 at 256; 8B TP=2 ITL 2.587 vs 2.590 ms)",
    )
    gpus: str | None = opt(
        None,
        "serve: comma-separated GPU indexes, one engine replica per group of "
        "--tensor-parallel-size GPUs (e.g. 0,1,2,3)",
    )
    cpu_threads: int | None = opt(None, "torch intra-op threads (fewer avoids stalls when cores are shared)")
    data_parallel_size: int | None = opt(
        None,
        "serve: engine replicas per model (default: one per --gpus group, else 1); on CUDA give --gpus",
        short="-dp",
    )

    def __post_init__(self) -> None:
        _at_least(self, 1, "tensor_parallel_size", "cpu_threads", "data_parallel_size")
        _at_least(self, 0, "custom_all_reduce_max_bytes", "fused_all_reduce_max_bytes")


@dataclass(slots=True)
class LoRAConfig:
    enable_lora: bool = opt(False, "serve LoRA adapters: a request's `model` names one (as vLLM)")
    lora_modules: list[str] = field(
        default_factory=list,
        metadata={"help": "adapters served from the start: name=path (PEFT folders), several allowed", "nargs": "+"},
    )
    max_loras: int = opt(1, "adapters held on the device at once (slots; the least recently used unpinned one goes)")
    max_lora_rank: int = opt(16, "the largest adapter rank served (up to 64)")
    allow_runtime_lora_updating: bool = opt(
        False,
        "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )

    def __post_init__(self) -> None:
        _at_least(self, 1, "max_loras", "max_lora_rank")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank: at most {MAX_LORA_RANK}")
        self.adapters()  # a malformed name=path fails now

    def adapters(self) -> dict[str, str]:
        """--lora-modules as name -> path."""
        named: dict[str, str] = {}
        for item in self.lora_modules:
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules: expected name=path, got {item!r}")
            named[name.strip()] = path.strip()
        return named


@dataclass(slots=True)
class EngineServiceConfig:
    engine_id: str = opt("", "this replica's id (default: a new random one)")
    heartbeat_interval_s: float = opt(1.0, "how often an engine refreshes its registry record")
    heartbeat_ttl_s: float = opt(5.0, "an engine silent this long is dead; its requests move")
    drain_timeout_s: float = opt(30.0, "on SIGTERM: finish what is running for at most this long")
    claim_idle_ms: int = opt(15_000, "claim a dead consumer's stream entries idle this long")
    metrics_port: int = opt(
        0, "Prometheus /metrics (pagedserve_* and vLLM's vllm:* names), /health and /ready on this port; 0 = off"
    )
    metrics_host: str = opt(
        "127.0.0.1",
        "address of the metrics port (0.0.0.0 where a scraper on another host reads it: compose, Kubernetes)",
    )
    engine_nice: int = opt(
        0,
        "niceness of the engine's processes (-20..19); negative puts its step loop ahead of other work on a host "
        "whose cores are shared (clients, gateways): needs root or CAP_SYS_NICE",
    )

    def __post_init__(self) -> None:
        if not -20 <= self.engine_nice <= 19:
            raise ValueError("engine_nice: must be in -20..19")


@dataclass(slots=True)
class TokenizerServiceConfig:
    consumer_name: str = opt("", "this tokenizer's consumer name (default: a new random one)")
    tokenizer_workers: int | None = opt(
        None,
        "tokenizer processes `serve` starts per model, sharing its request stream (default: half the gateway "
        "workers, at least 1): a burst of requests reaches the engine that much sooner",
    )
    claim_idle_ms: int = opt(30_000, "claim a dead consumer's stream entries idle this long")
    metrics_port: int = opt(0, "Prometheus /metrics, /health and /ready on this port; 0 = off")
    metrics_host: str = opt(
        "127.0.0.1",
        "address of the metrics port (0.0.0.0 where a scraper on another host reads it: compose, Kubernetes)",
    )
    tokenizer_heartbeat_interval_s: float = opt(1.0, "how often a tokenizer refreshes its registry record")
    tokenizer_heartbeat_ttl_s: float = opt(5.0, "a tokenizer silent this long is gone: gateways answer 503 at once")


@dataclass(slots=True)
class GatewayConfig:
    host: str = opt("127.0.0.1", "listen address (loopback by default; 0.0.0.0 for every interface)")
    port: int = opt(8000, "HTTP port")
    gateway_id: str = opt("", "this gateway's id (default: a new random one)")
    api_keys: list[str] = field(
        default_factory=list,
        metadata={
            "help": "a Bearer key clients must send (repeatable; env: comma-separated); none = no auth",
            "flag": "api_key",
        },
    )
    workers: int | None = opt(
        None,
        "gateway processes sharing the port (default: a quarter of the CPU cores, 1-4)",
        aliases=("--api-server-count",),
    )
    max_body_bytes: int = opt(4 * 1024 * 1024, "request bodies above this get 413")
    max_in_flight: int = opt(512, "requests in flight per gateway process; beyond it 429")
    request_timeout_s: float = opt(600.0, "a request running longer ends with a timeout error")
    accept_timeout_s: float = opt(30.0, "waiting for the tokenizer's answer")
    engine_silence_timeout_s: float = opt(60.0, "no token and no live engine for this long = error")
    registry_refresh_s: float = opt(1.0, "how often the gateway re-reads live engines")
    max_n: int = opt(16, "cap on n")
    max_stop: int = opt(16, "cap on stop strings")
    max_logit_bias: int = opt(1024, "cap on logit_bias entries")
    max_messages: int = opt(1024, "cap on chat messages")
    max_prompts: int = opt(64, "prompts x n of one batched completion")
    tool_call_parser: str = opt("hermes", "the model's tool-call format", choices=TOOL_CALL_PARSERS)
    enable_auto_tool_choice: bool = opt(True, "parse tool calls when tool_choice is auto (off: such requests get 400)")
    tool_call_grammar: bool = opt(
        True,
        "tool_choice auto: a call the model starts must name a tool and match its schema (an xgrammar structural "
        "tag on the family's start marker: hermes, qwen3_coder); text stays free",
    )
    reasoning_parser: str | None = opt(
        None,
        "chat answers carry the model's reasoning in reasoning_content (message and stream deltas), apart from content",
        choices=REASONING_PARSERS,
    )
    grammar_in_reasoning: bool = opt(
        False,
        "with a reasoning parser, a grammar (structured output, forced or held tool calls) applies from the first "
        "token, reasoning included; off (vLLM's default, its structured_outputs enable_in_reasoning): only after "
        "the reasoning ends",
    )
    responses_store_ttl_s: int = opt(
        3600,
        "a /v1/responses response with store=true is kept in Redis this long, for GET, DELETE and "
        "previous_response_id; 0 = never stored",
    )
    strict_request_fields: bool = opt(False, "unknown request fields get 400 instead of a warning")
    disable_log_requests: bool = opt(False, "no log line per request")
    uvicorn_log_level: str = opt(
        "warning", "uvicorn's log level", choices=("critical", "error", "warning", "info", "debug", "trace")
    )
    redis_max_connections: int = opt(16, "Redis connections of one gateway process")
    reuse_port: bool = opt(False, "SO_REUSEPORT on the listening socket (workers set it)")
    keep_alive_s: int = opt(75, "idle HTTP keep-alive (above clients' own idle expiry)")
    drain_timeout_s: float = opt(30.0, "on SIGTERM: let requests in flight finish for at most this long")
    grpc_port: int = opt(0, "the gRPC front door's port; 0 = off")
    max_queue_wait_s: float = opt(
        300.0,
        "a request with no first token after this long ends with 429 (an in-band "
        "error once streaming) and is aborted; below request_timeout_s, so overload says "
        "'retry' rather than 'timed out'",
    )
    sse_keepalive_s: float = opt(
        10.0,
        "a stream with nothing to send gets an SSE ': keep-alive' comment this often "
        "(below the 60 s proxies such as nginx allow a silent stream)",
    )
    max_worker_restarts_per_minute: int = opt(
        10,
        "dead gateway workers replaced per minute; beyond it the gateway "
        "stops and exits non-zero (a crash loop is not hidden)",
    )

    def __post_init__(self) -> None:
        _at_least(self, 1, "workers", "max_in_flight", "max_n")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:  # a flag is checked by argparse; env and files here
            raise ValueError(
                f"tool_call_parser: unknown {self.tool_call_parser!r} (expected one of {', '.join(TOOL_CALL_PARSERS)})"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser: unknown {self.reasoning_parser!r} (expected one of {', '.join(REASONING_PARSERS)})"
            )
        if not 0 < self.sse_keepalive_s <= 15:
            raise ValueError("sse_keepalive_s must be in (0, 15]: a queued stream must never look dead to a proxy")
        if self.max_queue_wait_s <= 0:
            raise ValueError("max_queue_wait_s must be positive")


@dataclass(slots=True)
class RoutingConfig:
    redis_url: str | None = opt(
        None,
        "Redis URL (redis://, rediss://, unix://, redis+sentinel://); serve starts a "
        "private redis-server when none is given",
    )
    stream_maxlen: int = opt(100_000, "streams are trimmed to about this many entries")
    abort_record_ttl_s: int = opt(
        3600,
        "how long an abort is remembered, so a tokenizer or engine that reads the request later (it was down) drops it",
    )
    redis_outage_grace_s: float = opt(
        30.0,
        "a Redis outage shorter than this loses no stream in flight: engines buffer their tokens and gateways "
        "keep streams open; past it, streams end with an error",
    )
    routing_policy: str = opt(
        "prefix",
        "how requests reach a model's engine replicas: prefix (to the replica whose KV cache holds the most of the "
        "prompt, weighed against its load; the rest pulled from one shared stream) or pull (all pulled)",
        aliases=("--routing",),
        choices=("prefix", "pull"),
    )
    prefix_max_queued: int = opt(4, "a replica with this many requests waiting gets no more routed to it by prefix")
    prefix_max_imbalance: int = opt(
        16, "a replica with this many requests more than the least loaded one gets no more routed to it by prefix"
    )
    prefix_min_hit_tokens: int = opt(
        64, "a cached prefix shorter than this is never worth routing for, whatever share of the prompt it is"
    )
    kv_snapshot_interval_s: float = opt(
        30.0, "how often an engine publishes all its cached prefix blocks (a router started later catches up)"
    )

    @property
    def url(self) -> str:
        """The Redis a service connects to (a lone service with none configured: the local default)."""
        return self.redis_url or "redis://127.0.0.1:6379/0"


@dataclass(slots=True)
class ObservabilityConfig:
    log_level: str = opt("INFO", "log level", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    trace_console: bool = opt(False, "print spans to the console (OTLP export: OTEL_EXPORTER_OTLP_ENDPOINT)")

    def __post_init__(self) -> None:
        self.log_level = self.log_level.upper()


@dataclass(slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    engine: EngineServiceConfig = field(default_factory=EngineServiceConfig)
    tokenizer: TokenizerServiceConfig = field(default_factory=TokenizerServiceConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        if self.cache.kv_offload_gb > 0 and self.parallel.tensor_parallel_size > 1:
            # the ranks' own caches would need the same copies: not sent to them yet
            raise ValueError("kv_offload_gb: the host KV tier runs with tensor_parallel_size 1 only")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> Config:
        """The inverse of to_dict (no coercion: the values are already typed)."""
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = set(data) - set(sections)
        if unknown:
            raise ValueError(f"unknown config sections: {sorted(unknown)}")
        return cls(**{name: SECTIONS[name](**values) for name, values in data.items()})

    @classmethod
    def of(cls, **flat: Any) -> Config:
        """A tree from flat field names (`Config.of(model=path, num_kv_blocks=64)`): tests, benchmarks, offline use."""
        grouped: dict[str, dict[str, Any]] = {}
        for name, value in flat.items():
            if name not in FLAT_NAMES:
                raise TypeError(f"Config.of: unknown field {name!r}")
            section, field_name = FLAT_NAMES[name]
            grouped.setdefault(section, {})[field_name] = value
        return cls(**{section: SECTIONS[section](**values) for section, values in grouped.items()})

    def replace(self, **flat: Any) -> Config:
        """A copy with some fields changed, by flat name (each changed section is validated again)."""
        data = self.to_dict()
        for name, value in flat.items():
            section, field_name = FLAT_NAMES[name]
            data[section][field_name] = value
        return Config.from_dict(data)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def _flat_names() -> dict[str, tuple[str, str]]:
    """flat name -> (section, field): the field's name, or section_field where two sections share it."""
    owners: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            owners.setdefault(f.name, []).append(section)
    flat: dict[str, tuple[str, str]] = {}
    for name, sections in owners.items():
        for section in sections:
            flat[name if len(sections) == 1 else f"{section}_{name}"] = (section, name)
    return flat


FLAT_NAMES = _flat_names()
