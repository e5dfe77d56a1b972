"""Start the real services (Redis, tokenizer, engine, gateway) as processes for a benchmark, and stop them.

Benchmarks keep their own helpers here rather than importing tests/ (tests are not shipped or imported by
anything else).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedserve.shared.redis_server import PrivateRedis, free_port


@dataclass
class Servers:
    base_url: str
    redis: PrivateRedis
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log_dir: Path = Path(".")

    def stop(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.redis.stop()


def wait_ready(base_url: str, processes: list[subprocess.Popen[bytes]], timeout_s: float = 300) -> None:
    """Poll the gateway's /ready until it answers 200 (every model has a live engine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"a service exited during start-up (exit codes {[p.poll() for p in processes]})")
        try:
            if httpx.get(f"{base_url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"services at {base_url} not ready after {timeout_s}s")


def start_servers(engine_args: list[str]) -> Servers:
    """A private Redis plus one tokenizer, one engine (with `engine_args`) and a gateway on a free port."""
    redis = PrivateRedis().start()
    port = free_port()
    env = {**os.environ, "PAGEDSERVE_REDIS_URL": redis.url}
    me = [sys.executable, "-m", "pagedserve.services.cli"]
    log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-bench-"))
    commands = {
        "tokenizer": [*me, "tokenizer"],
        "engine": [*me, "engine", *engine_args],
        "gateway": [*me, "gateway", "--host", "127.0.0.1", "--port", str(port)],
    }
    servers = Servers(f"http://127.0.0.1:{port}", redis, log_dir=log_dir)
    for name, command in commands.items():
        log = (log_dir / f"{name}.log").open("wb")
        servers.processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        wait_ready(servers.base_url, servers.processes)
    except BaseException:
        servers.stop()
        raise
    return servers
