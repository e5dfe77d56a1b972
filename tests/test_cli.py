"""`pagedserve serve` flags that decide how many processes start where (no process is started here)."""

from __future__ import annotations

import pytest

from services.cli import build_parser, engine_replicas


def _replicas(*flags: str) -> list[tuple[list[str], dict[str, str]]]:
    return engine_replicas(build_parser().parse_args(["serve", *flags]))


def test_one_engine_on_the_given_device_without_gpus() -> None:
    assert _replicas() == [([], {})]
    assert _replicas("--device", "cuda:1") == [(["--device", "cuda:1"], {})]


def test_one_engine_per_gpu_each_seeing_only_its_own() -> None:
    assert _replicas("--gpus", "0,1,3") == [(["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": g}) for g in "013"]


def test_tensor_parallel_replicas_take_groups_of_gpus() -> None:
    assert _replicas("--gpus", "0,1,2,3", "--tensor-parallel-size", "2") == [
        (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": "0,1"}), (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": "2,3"})
    ]
    with pytest.raises(SystemExit):
        _replicas("--gpus", "0,1,2", "--tensor-parallel-size", "2")
