"""`pagedserve serve` flags that decide how many processes start where (no process is started here)."""

from __future__ import annotations

import pytest

from pagedserve.services.cli import engine_replicas, parse_config, service_commands


def _replicas(*flags: str) -> list[tuple[str, dict[str, str]]]:
    _, config = parse_config(["serve", *flags])
    return [(replica.parallel.device, env) for replica, env in engine_replicas(config)]


def test_one_engine_on_the_given_device_without_gpus() -> None:
    assert _replicas() == [("auto", {})]
    assert _replicas("--device", "cuda:1") == [("cuda:1", {})]


def test_one_engine_per_gpu_each_seeing_only_its_own() -> None:
    assert _replicas("--gpus", "0,1,3") == [("cuda", {"CUDA_VISIBLE_DEVICES": g}) for g in "013"]


def test_tensor_parallel_replicas_take_groups_of_gpus() -> None:
    assert _replicas("--gpus", "0,1,2,3", "--tensor-parallel-size", "2") == [
        ("cuda", {"CUDA_VISIBLE_DEVICES": "0,1"}),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "2,3"}),
    ]
    with pytest.raises(SystemExit):
        _replicas("--gpus", "0,1,2", "--tensor-parallel-size", "2")


def test_data_parallel_size_starts_that_many_replicas() -> None:
    assert _replicas("--device", "cpu", "-dp", "3") == [("cpu", {})] * 3
    assert _replicas("--gpus", "0,1", "--data-parallel-size", "2") == [
        ("cuda", {"CUDA_VISIBLE_DEVICES": g}) for g in "01"
    ]
    with pytest.raises(SystemExit):  # two replicas on one GPU would each take --gpu-memory-utilization of it
        _replicas("--device", "cuda", "-dp", "2")
    with pytest.raises(SystemExit):  # --gpus makes two replicas, not four
        _replicas("--gpus", "0,1", "-dp", "4")


def _services(*flags: str, models: tuple[str | None, ...] = (None,)) -> list[str]:
    _, config = parse_config(["serve", *flags])
    return [command[-1] for command, _ in service_commands(config, list(models))]


def test_serve_starts_half_as_many_tokenizers_as_gateway_workers_per_model() -> None:
    assert _services("--workers", "4") == ["tokenizer", "tokenizer", "engine", "gateway"]
    assert _services("--workers", "1") == ["tokenizer", "engine", "gateway"]
    assert _services("--workers", "2", "--tokenizer-workers", "3", models=("a", "b")) == [
        *("tokenizer", "tokenizer", "tokenizer", "engine") * 2,
        "gateway",
    ]
