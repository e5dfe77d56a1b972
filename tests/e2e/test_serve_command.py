"""`pagedserve serve`: one command starts a private Redis and every service, and Ctrl-C stops them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from pagedserve.shared.redis_server import free_port

# Typed as a `vllm serve` user types them; each must reach the process that honours it.
VLLM_FLAGS = [
    "--served-model-name",
    "smol",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "6",
    "--block-size",
    "8",
    "--max-num-batched-tokens",
    "512",
    "--enforce-eager",
    "--dtype",
    "float",
    "--kv-cache-dtype",
    "auto",
    "--load-format",
    "safetensors",
    "--seed",
    "3",
    "--no-enable-prefix-caching",
    "--api-key",
    "k",
    "--gpu-memory-utilization",
    "0.8",
    "--generation-config",
    "vllm",
    "--uvicorn-log-level",
    "warning",
    "--disable-log-requests",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--trust-remote-code",
    "-tp",
    "1",
    "--api-server-count",  # two gateway workers: /v1/models must answer alike from both
    "2",
]


def test_serve_starts_everything_and_sigint_stops_everything(smollm2_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_REDIS_URL"}  # no Redis configured
    env["PAGEDSERVE_CPU_THREADS"] = "1"
    log = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedserve",
            "serve",
            str(smollm2_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *VLLM_FLAGS,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}"
    listings: list[list[str]] = []  # /v1/models from start, each on a new connection (any worker)
    stop_polling = threading.Event()
    poller = threading.Thread(target=_poll_models, args=(base_url, listings, stop_polling), daemon=True)
    poller.start()
    try:
        deadline = time.monotonic() + 300
        while "pagedserve: ready" not in (tmp_path / "serve.log").read_text():  # said only once it is so
            assert serve.poll() is None and time.monotonic() < deadline, "serve never said it was ready"
            time.sleep(0.2)
        # ready on every worker (each call a new connection): one still loading a tokenizer keeps all at 503
        assert [httpx.get(f"{base_url}/ready", timeout=5).status_code for _ in range(8)] == [200] * 8
        time.sleep(2)  # a few more answers from both workers after the first listing
        stop_polling.set()
        poller.join()
        first = next(i for i, listed in enumerate(listings) if listed)
        assert all(listed == ["smol"] for listed in listings[first:]), f"listed, then not: {listings[first:]}"
        assert len(listings) - first >= 5
        assert httpx.get(f"{base_url}/ready", timeout=5).status_code == 200
        assert httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 401  # --api-key
        models = httpx.get(f"{base_url}/v1/models", headers={"Authorization": "Bearer k"}, timeout=5).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("smol", 1024)]
        output = (tmp_path / "serve.log").read_text()
        assert "ignoring --trust-remote-code" in output
        engine_line = next(line for line in output.splitlines() if "engine settings: " in line)
        engine = json.loads(engine_line.split("engine settings: ", 1)[1])
        assert engine["scheduler"] == {**engine["scheduler"], "max_num_seqs": 6, "max_num_batched_tokens": 512}
        assert engine["cache"] == {
            **engine["cache"],
            "block_size": 8,
            "enable_prefix_caching": False,
            "gpu_memory_utilization": 0.8,
            "kv_cache_dtype": "auto",
        }
        assert engine["model"] == {
            **engine["model"],
            "dtype": "float32",
            "seed": 3,
            "load_format": "auto",
            "generation_config": "vllm",
            "served_model_name": "smol",
        }
        assert engine["runner"]["enforce_eager"] is True and engine["parallel"]["tensor_parallel_size"] == 1
        assert "KV blocks of 8 tokens, max_model_len 1024" in output
        children = psutil.Process(serve.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and all(s in names for s in ("tokenizer", "engine", "gateway"))
        gateway = next(c for c in psutil.Process(serve.pid).children() if "gateway" in " ".join(c.cmdline()))
        workers = [c for c in gateway.children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 2  # --api-server-count

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        reply = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=12,
        )
        assert "Paris" in (reply.choices[0].message.content or "")

        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"left running: {[p.cmdline() for p in alive]}"
    finally:
        if serve.poll() is None:
            serve.kill()
        output = (tmp_path / "serve.log").read_text()
        if "started a private redis-server" not in output:
            pytest.fail(f"serve did not say it started a private Redis:\n{output[-2000:]}")


def _poll_models(base_url: str, listings: list[list[str]], stop: threading.Event) -> None:
    """What a deploy script or load balancer sees while the server starts: one listing per new connection."""
    while not stop.is_set():
        try:
            reply = httpx.get(f"{base_url}/v1/models", headers={"Authorization": "Bearer k"}, timeout=5)
        except httpx.HTTPError:  # not listening yet
            time.sleep(0.05)
            continue
        if reply.status_code == 200:
            listings.append([m["id"] for m in reply.json()["data"]])
        time.sleep(0.05)
