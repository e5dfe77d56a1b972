"""How an engine runs its model: `make_executor` picks one process or tensor-parallel ranks.

The engine talks to an executor only through `runner` (rank 0's ModelRunner: launch a step, read
its results) and `shutdown()`; it never knows how many ranks there are. Both executors build their
runner through the same `Worker` (worker.py), which the worker ranks build too.

    Engine ── runner.launch/result ──► UniprocExecutor   (worker: the whole model)
                                   └─► MultiprocExecutor (worker: rank 0's shard; ranks 1.. as subprocesses)
"""

from __future__ import annotations

from typing import Protocol

from pagedserve.services.engine.executor.multiproc import MultiprocExecutor
from pagedserve.services.engine.executor.uniproc import UniprocExecutor
from pagedserve.services.engine.executor.worker import Worker
from pagedserve.services.engine.model_runner import ModelRunner
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.step_profile import StepProfile
from pagedserve.shared.config import Config

__all__ = ["Executor", "MultiprocExecutor", "UniprocExecutor", "Worker", "make_executor"]


class Executor(Protocol):
    runner: ModelRunner  # rank 0's
    world_size: int

    @property
    def worker_pids(self) -> list[int]:
        """The other ranks' processes (none on one process)."""

    def shutdown(self) -> None: ...


def make_executor(config: Config, model: CausalLM | None = None, profile: StepProfile | None = None) -> Executor:
    """The executor the config asks for; `model` (one process only) skips loading one."""
    if config.parallel.tensor_parallel_size > 1:
        if model is not None:
            raise ValueError("model: a tensor-parallel engine loads its own shards")
        return MultiprocExecutor(config, profile)
    return UniprocExecutor(config, model, profile)
