"""Session-wide fixtures: a private Redis server, and the real services started once as processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from pagedserve.shared.model_source import DEFAULT_MODEL, resolve_model_dir

# Without a GPU the Triton kernels run in the interpreter. Set it here, before any test module can
# import triton (transformers does, in some code paths): triton reads it once, on first use.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if TYPE_CHECKING:  # redis and httpx are imported lazily: the GPU machine runs tests without them
    from pagedserve.shared.redis_server import PrivateRedis
    from tests.otlp_receiver import OTLPReceiver

E2E_MAX_MODEL_LEN = 2048  # small enough that an over-long prompt is cheap to build


@pytest.fixture(scope="session")
def redis_server() -> Iterator[PrivateRedis]:
    from pagedserve.shared.redis_server import PrivateRedis

    server = PrivateRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model_dir(None)


@dataclass
class RunningServices:
    base_url: str
    redis_url: str
    model: str
    processes: dict[str, subprocess.Popen[bytes]]
    log_dir: Path
    metrics_ports: dict[str, int] | None = None  # Prometheus ports of the tokenizer and the engine
    otlp: OTLPReceiver | None = None  # where the services export their spans


def wait_ready(base_url: str, processes: dict[str, subprocess.Popen[bytes]], timeout_s: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [name for name, p in processes.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"service(s) exited during start-up: {dead}")
        try:
            if httpx.get(f"{base_url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"services at {base_url} not ready after {timeout_s}s")


def start_service(name: str, args: list[str], env: dict[str, str], log_dir: Path) -> subprocess.Popen[bytes]:
    log = (log_dir / f"{name}.log").open("wb")
    command = [sys.executable, "-m", "pagedserve.services.cli", *args]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def stop_all(processes: dict[str, subprocess.Popen[bytes]]) -> None:
    for p in processes.values():
        if p.poll() is None:
            p.terminate()
    for p in processes.values():
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()


@contextmanager
def running_stack(
    env: dict[str, str],
    log_dir: Path,
    engine_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
) -> Iterator[tuple[str, dict[str, subprocess.Popen[bytes]]]]:
    """Tokenizer, engine (CPU, fp32, one torch thread: it shares the cores with the gateway, the tokenizer
    and the client) and gateway for the default model, as separate processes: (base URL, processes) once
    ready; stopped on exit, with each log's tail printed (shown on failure by pytest's -ra summary)."""
    from pagedserve.shared.redis_server import free_port

    port = free_port()
    length = ["--max-model-len", str(E2E_MAX_MODEL_LEN)]
    engine = ["engine", "--device", "cpu", "--dtype", "float32", "--cpu-threads", "1", *engine_args, *length]
    gateway = ["gateway", "--host", "127.0.0.1", "--port", str(port), *gateway_args]
    processes = {
        "tokenizer": start_service("tokenizer", ["tokenizer", *length], env, log_dir),
        "engine": start_service("engine", engine, env, log_dir),
        "gateway": start_service("gateway", gateway, env, log_dir),
    }
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, processes)
        yield base_url, processes
    finally:
        stop_all(processes)
        for name in processes:
            print(f"----- {name} log (tail) -----\n" + (log_dir / f"{name}.log").read_text()[-3000:])


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OTLPReceiver]:
    from tests.otlp_receiver import OTLPReceiver

    receiver = OTLPReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def services(
    redis_server: PrivateRedis,
    smollm2_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    otlp_receiver: OTLPReceiver,
) -> Iterator[RunningServices]:
    """Tokenizer, engine and gateway for the default model, as separate processes on a private Redis,
    exporting spans to the in-test OTLP receiver and metrics on ports of their own. LoRA is on, with no
    adapter until a test loads one at run time (tests/e2e/test_lora.py); base requests skip it on a CPU."""
    from pagedserve.shared.redis_server import free_port

    log_dir = tmp_path_factory.mktemp("service-logs")
    metrics_ports = {"tokenizer": free_port(), "engine": free_port()}
    env = {
        **os.environ,
        "PAGEDSERVE_REDIS_URL": redis_server.url,
        "PAGEDSERVE_LOG_LEVEL": "INFO",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "PAGEDSERVE_TOKENIZER_METRICS_PORT": str(metrics_ports["tokenizer"]),
        "PAGEDSERVE_ENGINE_METRICS_PORT": str(metrics_ports["engine"]),
    }
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    with running_stack(env, log_dir, engine_args=lora, gateway_args=["--allow-runtime-lora-updating"]) as (
        base_url,
        processes,
    ):
        yield RunningServices(
            base_url, redis_server.url, DEFAULT_MODEL, processes, log_dir, metrics_ports, otlp_receiver
        )
