"""The tensor-parallel executor: rank 0 in this process, ranks 1.. as worker subprocesses.

Workers are plain subprocesses (`python -m pagedserve.services.engine.executor.worker`) that inherit
the environment (NCCL_* and CUDA settings included) and get the whole Config as JSON. A worker that
exits while the replica runs takes the whole replica down at once: the other workers are killed and
this process exits, so its heartbeat stops and the gateway's failover moves its requests. Workers
in turn exit when this process disappears (they watch their parent).

    rank 0 (the engine process)                         ranks 1..N-1 (worker.py)
    scheduler, Redis I/O, heartbeat, sampling
    ModelRunner.launch ── StepSender.send ──(gloo)──►   StepReceiver.recv -> follow_step
         forward shard  ◄────── all-reduce / all-gather (NCCL | gloo) ──────►  forward shard
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import torch

from pagedserve.services.engine.config import torch_device
from pagedserve.services.engine.executor.worker import Worker
from pagedserve.services.engine.parallel.state import all_reduce_limits, init_parallel, shutdown_parallel
from pagedserve.services.engine.parallel.step_broadcast import StepSender
from pagedserve.services.engine.step_profile import StepProfile
from pagedserve.shared.config import Config

log = logging.getLogger(__name__)
EXIT_RANK_DIED = 70


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MultiprocExecutor:
    def __init__(self, config: Config, profile: StepProfile | None = None) -> None:
        world = config.parallel.tensor_parallel_size
        if torch_device(config).type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size: {world} needs {world} GPUs; {torch.cuda.device_count()} visible")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        config_json = json.dumps(config.to_dict())
        threads = str(torch.get_num_threads())
        self.workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pagedserve.services.engine.executor.worker",
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(world),
                    "--init-method",
                    init_method,
                    "--parent-pid",
                    str(os.getpid()),
                    "--num-threads",
                    threads,
                    "--config",
                    config_json,
                ]
            )
            for rank in range(1, world)
        ]
        self._closing = threading.Event()
        self._monitor = threading.Thread(target=self._watch_workers, name="tp-worker-watch", daemon=True)
        self._monitor.start()
        ctx = init_parallel(
            0,
            world,
            init_method,
            torch_device(config),
            config.parallel.parallel_timeout_s,
            *all_reduce_limits(config.parallel),
        )
        self.world_size = world
        self._sender = StepSender(ctx)
        atexit.register(self.shutdown)
        log.info("tensor parallel: %d ranks (%s), worker pids %s", world, init_method, self.worker_pids)
        self.worker = Worker(config, ctx)  # the same build as the worker ranks', step for step
        self.runner = self.worker.build_runner(profile, step_sender=self._sender)

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def _watch_workers(self) -> None:
        while not self._closing.wait(0.2):
            if any(w.poll() is not None for w in self.workers) and not self._closing.is_set():
                self._end_replica()

    def _end_replica(self) -> None:
        """A worker died: kill the others and exit with EXIT_RANK_DIED (no collective can complete now)."""
        dead = next(w for w in self.workers if w.poll() is not None)
        log.error("tensor-parallel worker pid %d exited (code %s): taking the replica down", dead.pid, dead.returncode)
        for w in self.workers:
            if w.poll() is None:
                w.kill()
        logging.shutdown()
        os._exit(EXIT_RANK_DIED)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tell the workers to exit, wait for them (kill stragglers), leave the groups. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if any(w.poll() not in (None, 0) for w in self.workers):
            # A worker died first and this rank's collective failed before the watcher saw it: the
            # replica still ends the way the watcher ends it.
            self._end_replica()
        try:
            self._sender.send_stop()
        except Exception as exc:  # a worker already gone: it is killed below
            log.warning("could not send stop to tensor-parallel workers: %s", exc)
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            try:
                w.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        shutdown_parallel()
