"""`python -m bench moe_kernel --quick [--mxfp4]`: the fused-MoE benchmark's plumbing on tiny shapes, interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_quick_run_checks_the_kernel_and_writes_its_record(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    env = os.environ | {"TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "bench", "moe_kernel", "--quick", "--sweep", "--tokens", "3", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "MOE_TUNED[(8, 2, 64, 32, 'float32')]" in done.stdout
    record = json.loads(out.read_text())
    assert record["command"].endswith(f"--json {out}") and record["shape"]["num_experts"] == 8
    (row,) = record["results"]
    assert row["num_tokens"] == 3 and 1 <= row["experts_hit"] <= 6
    assert row["max_rel_error"] < 1e-5  # fp32 kernel vs the torch reference
    assert row["floor_us"] > 0 and row["kernel_us"] > 0 and row["best_us"] <= row["kernel_us"]


def test_quick_mxfp4_run_compares_the_packed_kernel_with_the_dense_one(tmp_path: Path) -> None:
    out = tmp_path / "moe_mxfp4.json"
    env = os.environ | {"TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "bench", "moe_kernel", "--quick", "--mxfp4", "--tokens", "1,3", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["variant"] == "mxfp4" and record["shapes"]["quick"]["intermediate"] == 64
    assert [row["num_tokens"] for row in record["results"]] == [1, 3]
    for row in record["results"]:
        assert row["max_rel_error"] < 1e-5 and row["kernel_vs_fp32"] < 1e-5  # fp32: the dequantisation is exact
        assert row["floor_us"] > 0 and row["kernel_us"] > 0 and row["dense_kernel_us"] > 0
