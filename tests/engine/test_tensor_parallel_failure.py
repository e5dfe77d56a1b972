"""A rank that dies takes its tensor-parallel replica down: no rank waits in a collective forever.

Rank 0 runs in a subprocess (it would otherwise take pytest down with it), generating in a loop so
that the ranks are busy in collectives when one of them is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pagedserve.services.engine.executor.multiproc import EXIT_RANK_DIED

_RANK0 = """
import sys, torch
torch.set_num_threads(1)
from pagedserve.shared.config import Config
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.sampling_params import SamplingParams
engine = Engine(Config.of(model=str(sys.argv[1]), tensor_parallel_size=2, num_kv_blocks=64, parallel_timeout_s=20))
print("READY", engine.executor.worker_pids[0], flush=True)
while True:
    engine.generate([[5, 6, 7, 8]] * 4, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
"""


def _start_replica(model_dir: Path) -> tuple[subprocess.Popen[str], int]:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", _RANK0, str(model_dir)],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    return proc, int(line.split()[1])


def _wait_gone(pid: int, timeout_s: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout=timeout_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.timeout(180)
def test_killing_rank1_ends_the_replica(tiny_model_dir: Path) -> None:
    proc, worker_pid = _start_replica(tiny_model_dir)
    try:
        time.sleep(1.0)  # mid-generation
        os.kill(worker_pid, signal.SIGKILL)
        start = time.monotonic()
        assert proc.wait(timeout=30) == EXIT_RANK_DIED
        assert time.monotonic() - start < 30
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(180)
def test_killing_rank0_ends_the_workers(tiny_model_dir: Path) -> None:
    proc, worker_pid = _start_replica(tiny_model_dir)
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    assert _wait_gone(worker_pid, timeout_s=30), "the worker rank outlived rank 0"
