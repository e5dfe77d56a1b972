"""What the engine core derives from the configuration tree (`pagedserve.shared.config.Config`): the torch
device, the KV cache's element type and the model directory. The tree itself is the only copy of the settings:
the engine, runner, scheduler and cache manager read its sections.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.shared.config import Config
from pagedserve.shared.model_source import resolve_model_dir


def torch_device(config: Config) -> torch.device:
    """`auto` is cuda when a GPU is visible, else cpu."""
    device = config.parallel.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def kv_cache_torch_dtype(config: Config) -> torch.dtype | None:
    """The KV cache's element type, None for the model's own dtype."""
    return torch.float8_e4m3fn if config.cache.kv_cache_dtype == "fp8" else None


def is_async_scheduling(config: Config) -> bool:
    """Schedule step N+1 before step N's tokens reach the host: on CUDA unless set."""
    if config.runner.async_scheduling is not None:
        return config.runner.async_scheduling
    return torch_device(config).type == "cuda"


def model_dir(config: Config) -> Path:
    """The local checkpoint directory of `config.model.model` (a name, directory, .gguf or hub id)."""
    return resolve_model_dir(config.model.model)
