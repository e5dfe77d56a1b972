"""Kernel tests run compiled on a CUDA machine and under the Triton interpreter everywhere else.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when it
wraps a function), which is why this happens at conftest import time and the test modules import
the kernels only after `pytest.importorskip("triton")`.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
