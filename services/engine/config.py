"""Engine configuration (the model loader resolves dtype "auto"; the engine sizes the KV cache).

Built once by the caller (the engine service's settings, a benchmark, a test) and passed down;
nothing here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(slots=True)
class EngineConfig:
    model_dir: str | Path
    dtype: str = "auto"  # "auto" (fp32 on CPU, 16-bit on CUDA) | "float32" | "bfloat16" | "float16"
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: CPU a fixed budget, CUDA from gpu_memory_utilization
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max position (capped by the KV cache)
    enable_prefix_caching: bool = True
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    max_num_waiting: int | None = None  # has_room() is False beyond this; None: max_num_seqs // 4 (>= 8)
    watermark_fraction: float = 0.01  # has_room() keeps this share of blocks free
    # CUDA only: decode steps of up to this many sequences replay captured graphs (0 = eager always).
    cuda_graph_max_batch: int = 512
    # Schedule and launch step N+1 before step N's tokens reach the host. None: on CUDA only.
    async_scheduling: bool | None = None
    warm_up: bool = True  # CUDA: compile kernels and capture graphs at start-up, not on the first request
    profile_steps: bool = False  # time each step's phases (Engine.profile)
    quantization: str | None = None  # "fp8": FP8 weights; None: as the checkpoint is (see models/fp8.py)
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype | "fp8": float8_e4m3fn with per-layer scales
    # One replica as this many processes, one per GPU (services/engine/parallel); rank 0 is this one.
    tensor_parallel_size: int = 1
    parallel_timeout_s: float = 120.0  # a collective waiting longer than this fails (a rank died)
    load_format: str = "auto"  # "auto": the checkpoint's safetensors | "random": random weights from `seed`
    tokenizer: str | Path | None = None  # for grammars (structured output); None: model_dir's

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: unknown {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks: must be >= 1")
        if self.cuda_graph_max_batch < 0:
            raise ValueError("cuda_graph_max_batch: must be >= 0")
        if self.quantization not in (None, "none", "fp8"):
            raise ValueError(f"quantization: unknown {self.quantization!r} (expected fp8)")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype: unknown {self.kv_cache_dtype!r} (expected auto or fp8)")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size: must be >= 1")
        if self.load_format not in ("auto", "random"):
            raise ValueError(f"load_format: unknown {self.load_format!r} (expected 'auto' or 'random')")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization: must be in (0, 1]")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype | None:
        """The KV cache's element type, None for the model's own dtype."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else None

    @property
    def is_async_scheduling(self) -> bool:
        return self.async_scheduling if self.async_scheduling is not None else self.torch_device.type == "cuda"

    @property
    def num_max_waiting(self) -> int:
        return self.max_num_waiting if self.max_num_waiting is not None else max(8, self.max_num_seqs // 4)
