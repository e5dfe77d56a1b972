"""`python -m bench`: one entry that lists and runs every benchmark."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.__main__ import benchmarks, main


def test_every_benchmark_with_a_main_is_listed(capsys: pytest.CaptureFixture[str]) -> None:
    known = benchmarks()
    assert {"throughput", "kernels", "serve", "scaling", "tensor_parallel"} <= known.keys()
    assert all(line for line in known.values()), "each benchmark says what it measures"
    assert main([]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in known)


def test_an_unknown_name_suggests_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["throughpt"]) == 2
    assert "did you mean throughput?" in capsys.readouterr().err


def test_a_benchmark_runs_with_its_own_arguments() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "scaling", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "usage: python -m bench scaling" in done.stdout and "--engines" in done.stdout
