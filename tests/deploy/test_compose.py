"""compose.yaml: it validates, and every command and healthcheck in it works, run as plain processes.

No container runtime runs here, so each service that can run without one runs locally: Redis (the
redis-server binary), the model preparation, tokenizer, engine and gateway (this checkout instead
of the image), and Prometheus (Debian's package). Their healthcheck commands are run as written
until they pass. Jaeger and Grafana exist only as images, and the GPU engines need GPUs: those are
checked for shape only (named here, so that a new service cannot slip through unchecked)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pagedserve.shared.model_source import DEFAULT_MODEL, cache_root
from pagedserve.shared.redis_server import free_port
from tests.deploy.compose_runner import COMPOSE_FILE, REPO, LocalService, load_compose, localize
from tests.otlp_receiver import OTLPReceiver

NOT_RUN_HERE = {
    "jaeger": "image only",
    "grafana": "image only",
    "engine-gpu0": "needs a GPU",
    "engine-gpu1": "needs a GPU",
}
RUN_ORDER = ["redis", "prepare", "tokenizer", "engine", "gateway", "prometheus"]
COMPOSE_SPEC = Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json")  # Debian's docker-compose


def _compose_cli() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def test_compose_config_validates() -> None:
    cli = _compose_cli()
    if cli is None and not COMPOSE_SPEC.exists():
        pytest.skip("neither docker compose, docker-compose nor the compose-spec schema is installed")
    if cli is not None:
        for profiles in ("cpu", "gpu,gpu-2"):
            result = subprocess.run(
                [*cli, "-f", str(COMPOSE_FILE), "config", "-q"],
                cwd=REPO,
                capture_output=True,
                text=True,
                env={**os.environ, "COMPOSE_PROFILES": profiles},
            )
            assert result.returncode == 0, result.stderr
    if COMPOSE_SPEC.exists():
        import jsonschema

        schema = json.loads(COMPOSE_SPEC.read_text())
        jsonschema.Draft201909Validator(schema).validate(yaml.safe_load(COMPOSE_FILE.read_text()))


def test_compose_shape() -> None:
    compose = load_compose({})
    services = compose["services"]
    assert set(services) == set(RUN_ORDER) | set(NOT_RUN_HERE)
    assert "ports" not in services["redis"] and "--requirepass" in services["redis"]["command"]
    assert services["engine"]["profiles"] == ["cpu"] and (REPO / ".env").read_text().count("COMPOSE_PROFILES=cpu")
    for gpu, index in (("engine-gpu0", "0"), ("engine-gpu1", "1")):
        (device,) = services[gpu]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["device_ids"] == [index] and device["capabilities"] == ["gpu"]
        assert services[gpu]["command"][-1] == "cuda"
    for name in ("tokenizer", "engine", "gateway", "engine-gpu0"):
        deps = services[name]["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy"
        assert deps["prepare"]["condition"] == "service_completed_successfully"
        assert "model-cache:/cache" in services[name]["volumes"]
        assert services[name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert services["gateway"]["depends_on"]["tokenizer"]["condition"] == "service_healthy"
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    for name in ("redis", "tokenizer", "engine", "gateway", "prometheus", "grafana", "engine-gpu0"):
        assert "healthcheck" in services[name], name
    for name in ("engine", "engine-gpu0"):  # longer than the engine's 30 s SIGTERM drain
        assert int(services[name]["stop_grace_period"].rstrip("s")) > 30
    published = {p.split(":")[-1] for s in services.values() for p in s.get("ports", [])}
    assert published == {"8000", "16686", "9090", "3000"}  # API, Jaeger UI, Prometheus, Grafana


def _wait_healthy(svc: LocalService, process: subprocess.Popen[bytes] | None, timeout_s: float) -> float:
    assert svc.healthcheck is not None
    started = deadline = time.monotonic()
    deadline += timeout_s
    while True:
        result = subprocess.run(svc.healthcheck, env=svc.env, capture_output=True, timeout=30)
        if result.returncode == 0:
            return time.monotonic() - started
        assert process is None or process.poll() is None, f"{svc.name} exited: {svc.argv}"
        assert time.monotonic() < deadline, f"{svc.name} never healthy: {svc.healthcheck} -> {result.stderr[-500:]!r}"
        time.sleep(1)


@pytest.mark.slow
def test_every_compose_command_and_healthcheck_runs(tmp_path: Path) -> None:
    if shutil.which("prometheus") is None:
        pytest.skip("Debian's prometheus package is not installed (.ci/run installs it)")
    variables = {"REDIS_PORT": str(free_port()), "REDIS_PASSWORD": "compose-test", "PROMETHEUS_PORT": str(free_port())}
    compose = load_compose(variables)
    ports = {"gateway": free_port(), "tokenizer": free_port(), "engine": free_port()}
    receiver = OTLPReceiver().start()  # stands in for Jaeger's OTLP endpoint
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)  # `python` in the commands: this interpreter
    base_env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(REPO),
        "TRITON_INTERPRET": "1",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    hosts = {
        "jaeger:4318": receiver.endpoint.removeprefix("http://"),
        "redis": "127.0.0.1",
        "prometheus": "127.0.0.1",
        "gateway": "127.0.0.1",
        "tokenizer": "127.0.0.1",
        "engine": "127.0.0.1",
    }
    paths = {
        "/cache": str(cache_root().parent),  # PAGEDSERVE_CACHE: the cached default model is reused
        "/etc/prometheus/prometheus.yml": str(REPO / "deploy/prometheus/prometheus.yml"),
        "/prometheus": str(tmp_path / "prometheus-data"),
    }
    overrides = {
        "tokenizer": {"PAGEDSERVE_TOKENIZER_METRICS_PORT": str(ports["tokenizer"])},
        # one torch thread and a short context: the CI machine's 2 cores and memory are shared
        "engine": {
            "PAGEDSERVE_ENGINE_METRICS_PORT": str(ports["engine"]),
            "PAGEDSERVE_CPU_THREADS": "1",
            "PAGEDSERVE_MAX_MODEL_LEN": "2048",
        },
        "gateway": {"PAGEDSERVE_PORT": str(ports["gateway"]), "PAGEDSERVE_HOST": "127.0.0.1"},
    }
    processes: dict[str, subprocess.Popen[bytes]] = {}
    timings: dict[str, float] = {}
    try:
        for name in RUN_ORDER:
            svc = localize(
                name,
                compose["services"][name],
                python=sys.executable,
                hosts=hosts,
                paths=paths,
                env_overrides={**base_env, **overrides.get(name, {})},
            )
            log = (tmp_path / f"{name}.log").open("wb")
            if name == "prepare":  # a one-shot job: it must exit 0 (service_completed_successfully)
                assert (
                    subprocess.run(
                        svc.argv, env=svc.env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=600
                    ).returncode
                    == 0
                )
                continue
            argv = ["prometheus", *svc.argv] if name == "prometheus" else svc.argv  # prometheus: the image's entrypoint
            processes[name] = subprocess.Popen(argv, env=svc.env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            timings[name] = _wait_healthy(svc, processes[name], timeout_s=300)

        # The stack answers, and its trace reaches the OTLP endpoint the compose file names (Jaeger's).
        reply = httpx.post(
            f"http://127.0.0.1:{ports['gateway']}/v1/chat/completions",
            timeout=120,
            json={"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        )
        assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 20
        while {s.service for s in receiver.spans} < {"pagedserve-gateway", "pagedserve-tokenizer", "pagedserve-engine"}:
            assert time.monotonic() < deadline, {s.service for s in receiver.spans}
            time.sleep(0.2)
        print("healthy after (s):", {k: round(v, 1) for k, v in timings.items()})
    finally:
        for p in reversed(processes.values()):
            p.terminate()
        for name, p in processes.items():
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
                print(f"{name} did not stop in 40 s")
        receiver.stop()
        for name in RUN_ORDER:
            log_path = tmp_path / f"{name}.log"
            if log_path.exists():
                print(f"----- {name} (tail) -----\n{log_path.read_text(errors='replace')[-1500:]}")
