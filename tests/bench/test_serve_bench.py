"""`python -m bench.serve --quick` against the real services (session fixture), and its pure parts."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.serve.client import RequestResult
from bench.serve.datasets import sample_length
from bench.serve.load import arrival_offsets
from bench.serve.metrics import summarize
from tests.conftest import RunningServices

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_bench(args: list[str], tmp_path: Path, name: str) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "bench.serve",
        "--quick",
        "--result-dir",
        str(tmp_path),
        "--result-name",
        name,
        *args,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads((tmp_path / f"{name}.json").read_text()))


def check_run(summary: dict[str, Any], num: int, output_len: int | None) -> None:
    assert summary["completed"] == summary["requests"] == num and summary["failed"] == 0, summary["errors"]
    if output_len is not None:
        assert summary["output_tokens"] == num * output_len
    assert summary["output_tokens"] == summary["expected_output_tokens"]  # ignore_eos: exactly max_tokens
    assert summary["ttft_ms"]["p50"] > 0 and summary["itl_ms"]["p50"] > 0 and summary["tpot_ms"]["p50"] > 0
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p90"] <= summary["ttft_ms"]["p99"]
    assert summary["e2e_ms"]["p50"] > summary["ttft_ms"]["p50"]
    assert summary["output_throughput"] > 0 and summary["total_token_throughput"] > summary["output_throughput"]
    assert summary["request_throughput"] > 0


def test_quick_run_with_sweep_offline_and_two_client_processes(services: RunningServices, tmp_path: Path) -> None:
    offline = ["--offline", "--offline-device", "cpu", "--offline-dtype", "float32", "--offline-cpu-threads", "1"]
    slos = ["--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000"]  # nothing can miss them
    report = run_bench(
        [
            "--url",
            services.base_url,
            "--model",
            services.model,
            "--concurrency-sweep",
            "1,4",
            "--client-processes",
            "2",
            *offline,
            *slos,
        ],
        tmp_path,
        "quick",
    )
    runs = report["runs"]
    check_run(runs["main"], 8, 8)
    assert runs["main"]["input_tokens"] == 8 * 32  # token-id prompts: exactly --input-len
    assert runs["main"]["goodput"]["good_requests"] == 8
    check_run(runs["single stream"], 2, 8)
    assert [row["max_concurrency"] for row in report["sweep"]] == [1, 4]
    for row in report["sweep"]:
        check_run(row, 8, 8)
    engine = report["offline"]
    assert engine["throughput"]["output_tokens"] == 8 * 8 and engine["throughput"]["output_throughput"] > 0
    assert engine["single"]["ttft_ms"]["p50"] > 0 and engine["single"]["itl_ms"]["p50"] > 0
    tax = report["pipeline_tax"]
    assert tax["served_over_offline"] == round(runs["main"]["output_throughput"] / tax["offline_output_throughput"], 3)
    assert tax["single_ttft_ms_p50"]["served"] == runs["single stream"]["ttft_ms"]["p50"]

    plots = [Path(p) for p in report["plots"]]
    assert sorted(p.name for p in plots) == ["quick_itl_cdf.png", "quick_throughput.png", "quick_ttft_cdf.png"]
    for plot in plots:
        assert plot.read_bytes()[:8] == PNG_MAGIC and plot.stat().st_size > 10_000
    markdown = (tmp_path / "quick.md").read_text()
    assert "Concurrency sweep" in markdown and "Pipeline tax" in markdown and "quick_ttft_cdf.png" in markdown


def test_quick_chat_mix_over_the_chat_endpoint(services: RunningServices, tmp_path: Path) -> None:
    report = run_bench(
        [
            "--url",
            services.base_url,
            "--model",
            services.model,
            "--endpoint",
            "chat",
            "--dataset",
            "chat-mix",
            "--num-prompts",
            "6",
            "--max-concurrency",
            "3",
            "--request-rate",
            "20",
        ],
        tmp_path,
        "chat",
    )
    main = report["runs"]["main"]
    check_run(main, 6, None)
    assert report["workload"]["prompt_format"] == "text"
    # chat-mix: prompts from 4 and 1/8 of --input-len (32): the chat template adds a few tokens
    assert main["input_tokens"] > 6 * 4


def test_poisson_arrivals_have_the_requested_rate() -> None:
    offsets = arrival_offsets(4000, rate=50.0, seed=3)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert math.isclose(statistics.mean(gaps), 1 / 50, rel_tol=0.06)
    assert math.isclose(statistics.stdev(gaps), 1 / 50, rel_tol=0.1)  # exponential: sd == mean
    assert arrival_offsets(5, math.inf, 0) == [0.0] * 5
    assert arrival_offsets(100, 5.0, seed=1) == arrival_offsets(100, 5.0, seed=1)


def test_length_distributions_stay_in_range() -> None:
    rng = random.Random(0)
    assert {sample_length(rng, 100, "fixed", 0.5) for _ in range(50)} == {100}
    for dist in ("uniform", "normal"):
        values = [sample_length(rng, 100, dist, 0.25) for _ in range(2000)]
        assert min(values) >= 75 and max(values) <= 125 and abs(statistics.mean(values) - 100) < 2
        assert len(set(values)) > 20


def test_summary_metrics_and_goodput() -> None:
    fast = RequestResult(
        start_wall=100.0, prompt_len=10, expected_output_len=5, output_tokens=5, ttft=0.1, itl=[0.05] * 4, latency=0.3
    )
    slow = RequestResult(
        start_wall=100.5, prompt_len=10, expected_output_len=5, output_tokens=5, ttft=1.0, itl=[0.05] * 4, latency=1.5
    )
    failed = RequestResult(start_wall=100.2, prompt_len=10, expected_output_len=5, error="HTTP 503: busy")
    s = summarize([fast, slow, failed], slo_ttft_ms=500, slo_tpot_ms=None)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert s["duration_s"] == 2.0 and s["output_tokens"] == 10 and s["output_throughput"] == 5.0
    assert s["ttft_ms"]["mean"] == 550.0 and s["itl_ms"]["p50"] == 50.0
    assert s["tpot_ms"]["mean"] == round((0.2 / 4 + 0.5 / 4) / 2 * 1e3, 3)
    assert s["goodput"]["good_requests"] == 1 and s["goodput"]["request_goodput"] == 0.5
