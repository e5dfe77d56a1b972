"""Shared fixtures for the model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Run a module's torch ops on one thread (use with `pytestmark = pytest.mark.usefixtures`).

    Small matmuls gain nothing from a second thread, and on a busy CI machine OpenMP spin-waits
    made the tiny-model tests ~50x slower (10 s instead of 0.2 s for one engine run).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
