"""The one-process executor: the whole model on one device, in the engine's own process."""

from __future__ import annotations

from pagedserve.services.engine.executor.worker import Worker
from pagedserve.services.engine.models.base import CausalLM
from pagedserve.services.engine.step_profile import StepProfile
from pagedserve.shared.config import Config


class UniprocExecutor:
    def __init__(self, config: Config, model: CausalLM | None = None, profile: StepProfile | None = None) -> None:
        self.world_size = 1
        self.worker_pids: list[int] = []  # no other ranks
        self.worker = Worker(config, model=model)
        self.runner = self.worker.build_runner(profile)

    def shutdown(self) -> None:
        """Nothing to stop: the runner goes with the engine."""
