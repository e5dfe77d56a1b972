"""compose.yaml for real: the image built from the Dockerfile and the CPU stack brought up with podman-compose.

What this machine lacks is stood in for, and nothing else is changed (tests/deploy/compose.podman.yaml):
- no registry: a Debian base made with debootstrap (cached under /var/cache/pagedserve-ci) is the image's
  BASE_IMAGE and, tagged redis:7-alpine, Redis (Debian's redis-server and redis-cli);
- torch from local disk: this machine's pip configuration (its find-links, indexes, constraints and CA
  bundle) is mounted into the build, and TORCH_SPEC names the local CPU wheel;
- no Jaeger image: tests/otlp_receiver.py runs as the trace collector in the pagedserve image;
- no systemd, so podman runs no healthcheck timers and podman-compose 1.x skips `service_healthy`
  conditions on podman 4.3: the test runs each container's healthcheck (`podman healthcheck run`, the
  command compose.yaml gives) until it passes;
- Prometheus and Grafana are not started (their configs are checked in test_compose.py); the test reads
  the gateway's /metrics itself.

Set up on first use (root, apt): podman, runc, debootstrap, and runc in /etc/containers/containers.conf
when no such file exists (crun cannot set rlimits here). Skipped, with the reason, where that fails.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.shared.model_source import DEFAULT_MODEL
from pagedserve.shared.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("PAGEDSERVE_CI_CACHE", "/var/cache/pagedserve-ci"))
BASE_IMAGE = "localhost/pagedserve-ci-base:bookworm"
REDIS_IMAGE = "docker.io/library/redis:7-alpine"  # what compose.yaml's `redis:7-alpine` resolves to
IMAGE = "localhost/pagedserve:latest"
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
MODEL = Path(DEFAULT_MODEL).name if "/" in DEFAULT_MODEL else DEFAULT_MODEL
SERVICES = ["redis", "prepare", "tokenizer", "engine", "gateway", "jaeger"]


def _run(cmd: list[str], timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(cmd)} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result


def _set_up_podman() -> str | None:
    """None once podman can run containers here, else why not."""
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    if missing:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            return f"{', '.join(missing)} missing and cannot be installed (not root or no apt)"
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        apt = subprocess.run(["apt-get", "install", "-y", "-qq", *missing], capture_output=True, text=True, env=env)
        if apt.returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env)
            apt = subprocess.run(["apt-get", "install", "-y", "-qq", *missing], capture_output=True, text=True, env=env)
        if apt.returncode != 0:
            return f"apt-get install {' '.join(missing)} failed: {apt.stderr[-500:]}"
    if not CONTAINERS_CONF.exists() and os.geteuid() == 0:
        CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
        CONTAINERS_CONF.write_text(
            '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=1000:1000"]\n[engine]\nruntime = "runc"\n'
        )
    if shutil.which("podman-compose") is None:
        return "podman-compose is not installed (pip install podman-compose: it is in the test extras)"
    probe = subprocess.run(["podman", "info"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"podman cannot run here: {probe.stderr[-500:]}"


def _has_image(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name]).returncode == 0


def _base_image() -> None:
    """A Debian bookworm base with Python 3.11 and Redis, made once (the root file system is cached)."""
    if not _has_image(BASE_IMAGE):
        rootfs = CACHE / "rootfs"
        if not (rootfs / "usr/bin/python3").exists():
            shutil.rmtree(rootfs, ignore_errors=True)
            CACHE.mkdir(parents=True, exist_ok=True)
            packages = "python3,python3-venv,ca-certificates,redis-server"
            _run(["debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", str(rootfs)], timeout=900)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True, capture_output=True)
        tar.wait()
    _run(["podman", "tag", BASE_IMAGE, REDIS_IMAGE])


def _pip_mounts() -> tuple[list[str], str | None]:
    """(podman build -v arguments giving the build this machine's pip configuration, a local torch CPU wheel
    for the base's Python 3.11, if pip's find-links hold one)."""
    config = _run(["python3", "-m", "pip", "config", "list"], check=False).stdout
    paths = {Path(p) for p in ("/etc/pip.conf", "/etc/xdg/pip", "/etc/ssl/certs/ca-certificates.crt")}
    for value in re.findall(r"='([^']*)'", config):
        for item in value.split():
            path = Path(item.removeprefix("file://"))
            if path.is_absolute():
                paths.add(path.parent if path.name == "simple" else path)
    mounts = [f"-v={p}:{p}:ro" for p in sorted(paths) if p.exists()]
    wheels = [w for p in paths if p.is_dir() for w in p.glob("torch-*+cpu-cp311-*.whl")]
    return mounts, str(sorted(wheels)[-1]) if wheels else None


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    base_url: str
    spans_url: str

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        cmd = ["podman-compose", "-p", self.project, "-f", "compose.yaml", "-f", "tests/deploy/compose.podman.yaml"]
        result = subprocess.run(
            [*cmd, "--profile", "cpu", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=self.env
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"podman-compose {' '.join(args)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
            )
        return result

    def containers(self, service: str) -> list[str]:
        out = _run(
            [
                "podman",
                "ps",
                "-a",
                "--filter",
                f"label=io.podman.compose.project={self.project}",
                "--filter",
                f"label=com.docker.compose.service={service}",
                "--format",
                "{{.Names}}",
            ]
        ).stdout
        return sorted(out.split())

    def wait_healthy(self, names: list[str], timeout_s: float = 300) -> None:
        """Run each container's compose healthcheck until it passes (no systemd timers run them here)."""
        deadline = time.monotonic() + timeout_s
        pending = set(names)
        while pending:
            for name in sorted(pending):
                if _run(["podman", "healthcheck", "run", name], check=False).returncode == 0:
                    pending.discard(name)
            if pending and time.monotonic() > deadline:
                logs = {n: _run(["podman", "logs", "--tail", "30", n], check=False).stderr for n in pending}
                raise AssertionError(f"not healthy after {timeout_s} s: {sorted(pending)}\n{logs}")
            time.sleep(2)

    def engine_running(self, name: str) -> int:
        """Requests running on one engine container, from its own /metrics (inside the container)."""
        script = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9400/metrics').read().decode())"
        text = _run(["podman", "exec", name, "python", "-c", script], check=False).stdout
        match = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE)
        return int(float(match.group(1))) if match else 0


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    why = _set_up_podman()
    if why is not None:
        pytest.skip(why)
    _base_image()
    mounts, torch_wheel = _pip_mounts()
    if torch_wheel is None:
        pytest.skip("no local torch CPU wheel for Python 3.11 in pip's find-links (the build cannot fetch torch here)")
    _run(
        [
            "podman",
            "build",
            "--network=host",
            "-t",
            IMAGE,
            *mounts,
            f"--build-arg=BASE_IMAGE={BASE_IMAGE}",
            f"--build-arg=TORCH_SPEC={torch_wheel}",
            "--build-arg=TORCH_INDEX=",
            ".",
        ],
        timeout=1200,
    )
    env = {
        **os.environ,
        "GATEWAY_PORT": str(free_port()),
        "OTLP_SPANS_PORT": str(free_port()),
        "JAEGER_UI_PORT": str(free_port()),
        "PAGEDSERVE_MAX_NUM_SEQS": "2",  # a replica takes at most 2 running + 8 waiting: a burst spreads
    }
    base_url, spans_url = f"http://127.0.0.1:{env['GATEWAY_PORT']}", f"http://127.0.0.1:{env['OTLP_SPANS_PORT']}/spans"
    stack = Stack(f"pstest{uuid.uuid4().hex[:6]}", env, base_url, spans_url)
    try:
        stack.compose("up", "-d", *SERVICES)
        stack.wait_healthy([c for s in ("redis", "tokenizer", "engine", "gateway") for c in stack.containers(s)])
        yield stack
    finally:
        try:
            stack.compose("down", "-v", "-t", "5", timeout=300)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"compose down failed: {exc}")
        # podman-compose's down stops the containers the file names; a replica added by --scale (engine_2)
        # outlived it and kept running after the tests
        project = f"label=io.podman.compose.project={stack.project}"
        listed = _run(["podman", "ps", "-a", "--filter", project, "--format", "{{.Names}}"], check=False)
        leftovers = listed.stdout.split()
        if leftovers:
            _run(["podman", "rm", "-f", "-t", "5", *leftovers], check=False)


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_runtime_image_holds_no_build_tree_or_cache(stack: Stack) -> None:
    """Multi-stage: the runtime image is the base and the virtual environment (its size is printed)."""
    size = int(_run(["podman", "image", "inspect", "--format", "{{.Size}}", IMAGE]).stdout)
    print(f"{IMAGE}: {size / 1e9:.2f} GB")
    leftovers = "ls -d /src /root/.cache/pip /opt/venv/lib/python3.11/site-packages/pip/_vendor/cachecontrol/.cache"
    assert _run(["podman", "run", "--rm", "--entrypoint", "sh", IMAGE, "-c", leftovers], check=False).returncode != 0
    version = _run(["podman", "run", "--rm", IMAGE, "--version"], check=False)
    assert version.returncode == 0 or "usage" in (version.stdout + version.stderr).lower()


def test_chat_completions_through_the_published_port(stack: Stack) -> None:
    client = _client(stack)
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content or ""
    assert text and whole.usage is not None and whole.usage.completion_tokens > 0
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == text


def test_two_engine_replicas_both_take_work(stack: Stack) -> None:
    stack.compose("up", "-d", "--no-deps", "--scale", "engine=2", "engine")
    engines = stack.containers("engine")
    assert len(engines) == 2
    stack.wait_healthy(engines)
    deadline = time.monotonic() + 60
    while True:  # the gateway serves a replica once its heartbeat is in Redis (a second or so)
        metrics = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
        if len(re.findall(r"^pagedserve_engine_requests_finished\{", metrics, re.MULTILINE)) == 2:
            break
        assert time.monotonic() < deadline, "the gateway does not list two engine replicas"
        time.sleep(1)

    async def burst() -> None:
        async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0) as client:
            await asyncio.gather(
                *(
                    client.completions.create(model=MODEL, prompt=f"{i} little pigs", max_tokens=24, temperature=0)
                    for i in range(24)
                )
            )

    asyncio.run(burst())
    time.sleep(2)  # the replicas' counts reach the gateway with their next heartbeat
    metrics = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    finished = [float(v) for v in re.findall(r"^pagedserve_engine_requests_finished\{[^}]*\} (\S+)$", metrics, re.M)]
    if not (len(finished) == 2 and all(n > 0 for n in finished)):  # say why: each replica's own log
        runs = {n: _run(["podman", "logs", "--tail", "40", n], check=False) for n in engines}
        logs = {n: run.stdout + run.stderr for n, run in runs.items()}
        raise AssertionError(f"finished per replica: {finished}\n{logs}")


def test_a_killed_engine_container_restarts_and_the_stream_completes(stack: Stack) -> None:
    client = _client(stack)
    ask = dict(model=MODEL, prompt="Once upon a time", max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
    reference = client.completions.create(**ask).choices[0].text
    stream = client.completions.create(**ask, stream=True)
    text, victim = "", None
    for chunk in stream:
        text += "".join(c.text for c in chunk.choices)
        if victim is None and len(text) > 10:
            serving = [name for name in stack.containers("engine") if stack.engine_running(name) > 0]
            assert serving, "no engine container reports the request running"
            victim = serving[0]
            _run(["podman", "kill", victim])
    assert victim is not None and text == reference
    _run(["podman", "start", victim])
    stack.wait_healthy([victim], timeout_s=180)


def test_metrics_and_a_trace_reach_the_collector(stack: Stack) -> None:
    trace_id = uuid.uuid4().hex
    headers = {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}
    reply = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        headers=headers,
        timeout=120,
    )
    assert reply.status_code == 200
    metrics = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    assert re.search(r"^vllm:e2e_request_latency_seconds_count\{[^}]*\} [1-9]", metrics, re.MULTILINE)
    deadline = time.monotonic() + 30  # the exporters send in batches
    services: set[str] = set()
    while time.monotonic() < deadline and len(services) < 3:
        spans = httpx.get(stack.spans_url, timeout=10).json()
        services = {s["service"] for s in spans if s["trace_id"] == trace_id}
        time.sleep(1)
    assert {"pagedserve-gateway", "pagedserve-tokenizer", "pagedserve-engine"} <= services, services
