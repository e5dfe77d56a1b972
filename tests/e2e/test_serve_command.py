"""`pagedserve serve`: one command starts a private Redis and every service, and Ctrl-C stops them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from shared.redis_server import free_port
from tests.conftest import wait_ready


def test_serve_starts_everything_and_sigint_stops_everything(smollm2_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_REDIS_URL"}  # no Redis configured
    env["PAGEDSERVE_ENGINE_CPU_THREADS"] = "1"
    log = (tmp_path / "serve.log").open("wb")
    serve = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "1024"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while "pagedserve: ready" not in (tmp_path / "serve.log").read_text():  # said only once it is so
            assert serve.poll() is None and time.monotonic() < deadline, "serve never said it was ready"
            time.sleep(0.2)
        assert httpx.get(f"{base_url}/ready", timeout=5).status_code == 200
        assert [m["id"] for m in httpx.get(f"{base_url}/v1/models", timeout=5).json()["data"]] == [
            "SmolLM2-135M-Instruct"]
        wait_ready(base_url, {"serve": serve})
        children = psutil.Process(serve.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and all(s in names for s in ("tokenizer", "engine", "gateway"))

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=12,
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
