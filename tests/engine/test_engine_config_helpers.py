"""What the engine core derives from the configuration tree."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.services.engine.config import is_async_scheduling, kv_cache_torch_dtype, model_dir, torch_device
from pagedserve.shared.config import Config


def test_device_auto_is_cpu_without_a_gpu() -> None:
    assert torch_device(Config.of(device="cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch_device(Config.of(device="auto")).type == expected


def test_kv_cache_dtype_fp8_is_e4m3_and_auto_is_the_models() -> None:
    assert kv_cache_torch_dtype(Config.of(kv_cache_dtype="fp8")) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype(Config.of(kv_cache_dtype="fp8_e4m3")) is torch.float8_e4m3fn  # vLLM's name
    assert kv_cache_torch_dtype(Config.of()) is None


def test_async_scheduling_defaults_to_cuda_only_unless_set() -> None:
    assert not is_async_scheduling(Config.of(device="cpu"))
    assert is_async_scheduling(Config.of(device="cpu", async_scheduling=True))


def test_model_dir_of_a_directory_is_that_directory(tiny_model_dir: Path) -> None:
    assert model_dir(Config.of(model=str(tiny_model_dir))).resolve() == tiny_model_dir.resolve()
