"""bench/model_shapes.py on its tiny shapes (CPU, in process): an MoE run, and Gemma 3's cache with window freeing
on and off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import model_shapes
from bench.shape_configs import SHAPES, TINY_WINDOW, tiny_config

NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN, BLOCK = 4, 96, 16, 16


def test_tiny_shapes_keep_their_family_quirks() -> None:
    gemma, gpt_oss = tiny_config(SHAPES["gemma-3-12b"]), tiny_config(SHAPES["gpt-oss-20b"])
    assert gemma["num_hidden_layers"] == 6 and gemma["sliding_window_pattern"] == 6  # 5 local : 1 global
    assert gpt_oss["num_hidden_layers"] == 2 and gpt_oss["sliding_window"] == TINY_WINDOW
    assert tiny_config(SHAPES["qwen3-30b-a3b"])["num_experts_per_tok"] == 2
    assert SHAPES["gemma-3-12b"]["sliding_window"] == 1024 and SHAPES["gpt-oss-20b"]["num_hidden_layers"] == 24


def test_tiny_run_reports_throughput_and_window_freeing_capacity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "shapes.json"
    argv = ["--tiny", "--device", "cpu", "--in-process", "--models", "qwen3-30b-a3b,gemma-3-12b"]
    argv += ["--num-requests", str(NUM_REQUESTS), "--prompt-len", str(PROMPT_LEN), "--output-len", str(OUTPUT_LEN)]
    # chunks of 256: a window group holds its window and one chunk, so the longest sequence grows with freeing
    model_shapes.main([*argv, "--cpu-kv-cache-mib", "8", "--max-num-batched-tokens", "256", "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.rstrip().splitlines()[-1] == f"wrote {out}"
    assert "| gemma-3-12b | none | 1 | off | - | - |" in printed  # the probe: capacity only

    moe, gemma_on, gemma_off = json.loads(out.read_text())["runs"]
    for run in (moe, gemma_on):
        (work,) = run["workloads"]
        assert work["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN and work["output_tokens_per_s"] > 0
        assert work["max_running"] == NUM_REQUESTS and work["preemptions"] == 0
        assert work["steps"] >= OUTPUT_LEN and work["mean_step_ms"] > 0
    assert not moe["is_hybrid"] and moe["window_freeing"] and moe["kv_groups"] == ["full x2"]

    assert gemma_on["is_hybrid"] and gemma_on["kv_groups"] == ["full x1"] + [f"window {TINY_WINDOW} x1"] * 5
    assert not gemma_off["window_freeing"] and "workloads" not in gemma_off and gemma_off["kv_groups"] == ["full x6"]
    # The same 8 MiB either way: blocks of one layer with freeing on, of all six without.
    assert gemma_on["layers_per_block"] == 1 and gemma_off["layers_per_block"] == 6
    assert gemma_on["kv_blocks"] == (8 << 20) // (2 * BLOCK * 2 * 16 * 4)  # k+v, 2 kv heads of 16, fp32
    assert gemma_off["kv_blocks"] == gemma_on["kv_blocks"] // 6
    # A 112-token sequence holds 7 blocks in each group without freeing; with it, a window group keeps 5.
    per_seq_on, per_seq_off = 7 + 5 * 5, 7
    assert gemma_on["workload_seqs_fit"] == gemma_on["kv_blocks"] // per_seq_on
    assert gemma_off["workload_seqs_fit"] == gemma_off["kv_blocks"] // per_seq_off
    assert gemma_on["workload_seqs_fit"] > gemma_off["workload_seqs_fit"]
    assert gemma_on["max_seq_tokens"] > 4 * gemma_off["max_seq_tokens"]
    assert gemma_on["workloads"][0]["peak_used_blocks"] < NUM_REQUESTS * 6 * 7  # window groups gave blocks back


def test_tiny_quantized_run_reports_each_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 4-bit shape's random weights in GPTQ's layout, two batch sizes on one engine: a row per batch."""
    out = tmp_path / "shapes.json"
    argv = ["--tiny", "--device", "cpu", "--in-process", "--models", "llama-3.1-8b", "--quantization", "gptq"]
    argv += ["--batches", "1,3", "--prompt-len", "32", "--output-len", "8", "--cpu-kv-cache-mib", "8"]
    model_shapes.main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    assert "| llama-3.1-8b | gptq | 1 | - | 1 |" in printed and "| llama-3.1-8b | gptq | 1 | - | 3 |" in printed
    (run,) = json.loads(out.read_text())["runs"]
    assert run["quantization"] == "gptq"
    assert [w["batch"] for w in run["workloads"]] == [1, 3]
    assert [w["output_tokens"] for w in run["workloads"]] == [8, 24]
    assert run["workloads"][1]["max_running"] == 3
