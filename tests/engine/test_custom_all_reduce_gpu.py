"""The custom all-reduce on 2 GPUs: bench/custom_all_reduce.py --check-only compares the plan's choice and
each forced algorithm (one-shot, two-shot) with NCCL for bf16 and fp32 from 2 KB to 8 MB, eagerly and
replayed from CUDA graphs, and checks every rank got the same bits (it exits non-zero otherwise).

    python3 -m pytest -q -o addopts='' --confcutdir=tests/engine tests/engine/test_custom_all_reduce_gpu.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def test_custom_all_reduce_matches_nccl_eager_and_in_graphs(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.custom_all_reduce", "--check-only", "--buffer-bytes", str(8 << 20)]
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "match NCCL" in done.stdout
    assert "equal the reference bit for bit" in done.stdout
