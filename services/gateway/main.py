"""`pagedserve gateway`: the HTTP front door, as one process or as N worker processes on one port.

    gateway --workers N ─┬─► worker 0: uvicorn on its own SO_REUSEPORT socket, gateway id <id>-0
                         ├─► worker 1: ...                                          <id>-1
                         └─► ...  (the kernel spreads new connections over the sockets)

Each worker is a whole gateway: its own response stream, router and publisher, so workers share
nothing but the port. One Python process tops out near 17k streamed tokens/s; workers add to that.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

import uvicorn
from prometheus_client import multiprocess

from services.gateway.app import build_app
from services.gateway.drain import DrainingServer
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)


def main(settings: GatewaySettings) -> None:
    if settings.workers > 1:
        run_workers(settings)
    else:
        serve(settings)


def serve(settings: GatewaySettings) -> None:
    """One gateway process; uvicorn picks uvloop and httptools (both installed) for its loop and parser."""
    sock = listening_socket(settings.host, settings.port, reuse_port=settings.reuse_port)
    app = build_app(settings)
    config = uvicorn.Config(
        app, log_level="info", access_log=False, backlog=max(2048, settings.max_in_flight),
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=5,  # after our own drain (drain.py) only idle connections are left
    )
    DrainingServer(config, app.state.frontend, settings.drain_timeout_s).run(sockets=[sock])


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run_workers(settings: GatewaySettings) -> None:
    """Start `settings.workers` gateways sharing the port; stop them all when one dies or on a signal."""
    context = multiprocessing.get_context("spawn")  # no forked event loops or Redis connections
    metrics_dir = _fresh_metrics_dir()
    workers = [
        context.Process(target=_worker, args=(worker_settings(settings, i),), name=f"gateway-{i}")
        for i in range(settings.workers)
    ]
    for worker in workers:
        worker.start()
    log.info("gateway: %d workers on %s:%d", len(workers), settings.host, settings.port)

    stopping = False

    def forward(signum: int, _: Any) -> None:
        nonlocal stopping
        stopping = True
        for worker in workers:
            if worker.pid is not None and worker.is_alive():
                os.kill(worker.pid, signum)  # each worker drains on SIGTERM, as one gateway does

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed = False
    gone: set[int] = set()
    while any(w.is_alive() for w in workers):
        for worker in workers:
            worker.join(timeout=0.2)
            if worker.exitcode is not None and worker.pid is not None and worker.pid not in gone:
                gone.add(worker.pid)
                multiprocess.mark_process_dead(worker.pid, metrics_dir)  # its live gauges stop counting
            if worker.exitcode not in (None, 0) and not stopping:
                failed = True  # a crashed worker: take the others down too, and say so
                log.error("gateway worker %s exited with %s; stopping the others", worker.name, worker.exitcode)
                forward(signal.SIGTERM, None)
    if failed:
        sys.exit(1)


def _fresh_metrics_dir() -> str:
    """prometheus-client's multiprocess directory, emptied: /metrics on any worker then sums them all."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="pagedserve-metrics-")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # the spawned workers inherit it
    return path


def worker_settings(settings: GatewaySettings, index: int) -> GatewaySettings:
    return settings.model_copy(update={"gateway_id": f"{settings.gateway_id}-{index}", "workers": 1,
                                       "reuse_port": True})


def _worker(settings: GatewaySettings) -> None:
    from shared.telemetry import setup_logging, setup_tracing

    setup_logging("gateway")
    setup_tracing("gateway")
    serve(settings)
