"""A Redis master, one replica and three sentinels on loopback ports, for failover tests."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from pagedserve.shared.redis_server import free_port, redis_server_binary

SERVICE = "pagedserve"
PASSWORD = "sentinel-test-secret"


class SentinelCluster:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pagedserve-sentinel-"))
        self.binary = redis_server_binary()
        self.master_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://:{PASSWORD}@{hosts}/{SERVICE}/0"

    def _start(self, name: str, args: list[str]) -> None:
        log = (self.dir / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen(
            [self.binary, *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.dir
        )

    def _server_args(self, port: int) -> list[str]:
        return [
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            PASSWORD,
            "--masterauth",
            PASSWORD,
            "--dir",
            str(self.dir),
        ]

    def start(self) -> SentinelCluster:
        self._start("master", self._server_args(self.master_port))
        self._start(
            "replica", [*self._server_args(self.replica_port), "--replicaof", "127.0.0.1", str(self.master_port)]
        )
        for i, port in enumerate(self.sentinel_ports):
            conf = self.dir / f"sentinel-{i}.conf"  # sentinels rewrite their config: one file each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel auth-pass {SERVICE} {PASSWORD}\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
                f"sentinel parallel-syncs {SERVICE} 1\n"
            )
            self._start(f"sentinel-{i}", [str(conf), "--sentinel"])
        self.wait_for_replication()
        return self

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, password=PASSWORD, socket_connect_timeout=0.5, socket_timeout=2)

    def wait_for_replication(self, timeout_s: float = 20) -> None:
        """Until the replica is in sync and every sentinel knows the replica and the other sentinels."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                info = self.client(self.replica_port).info("replication")
                ready = info.get("master_link_status") == "up"
                for port in self.sentinel_ports:
                    master: Any = redis.Redis(port=port, socket_timeout=1).sentinel_master(SERVICE)
                    ready = ready and master["num-slaves"] >= 1 and master["num-other-sentinels"] >= 2
            except redis.RedisError:
                ready = False
            if ready:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"sentinel cluster not ready; logs in {self.dir}")
            time.sleep(0.2)

    def master_address(self) -> tuple[str, int]:
        host, port = redis.Redis(port=self.sentinel_ports[0], socket_timeout=1).sentinel_get_master_addr_by_name(
            SERVICE
        )
        return host.decode() if isinstance(host, bytes) else str(host), int(port)

    def kill_master(self) -> None:
        self.processes["master"].send_signal(signal.SIGKILL)
        self.processes["master"].wait()

    def stop(self) -> None:
        for p in self.processes.values():
            if p.poll() is None:
                p.terminate()
        for p in self.processes.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
