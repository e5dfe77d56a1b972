"""`pagedserve gateway`: the HTTP front door, as one process or as N worker processes on one port.

    gateway --workers N ─┬─► worker 0: uvicorn on its own SO_REUSEPORT socket, gateway id <id>-0
                         ├─► worker 1: ...                                          <id>-1
                         └─► ...  (the kernel spreads new connections over the sockets)

A worker that dies is replaced under the same index (and gateway id), within a restart budget.
Each worker is a whole gateway: its own response stream, router and publisher, so workers share
nothing but the port and a byte each of readiness (worker_readiness.py: /ready holds for all or
none). One Python process tops out near 17k streamed tokens/s; workers add to that.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import Any

import uvicorn
from prometheus_client import multiprocess

from pagedserve.services.gateway.app import build_app
from pagedserve.services.gateway.drain import DrainingServer
from pagedserve.services.gateway.worker_readiness import WorkerReadiness
from pagedserve.shared.config import Config
from pagedserve.shared.heap import freeze_startup_heap
from pagedserve.shared.ids import new_id
from pagedserve.shared.telemetry import setup_logging, setup_tracing

log = logging.getLogger(__name__)
# After drain_timeout_s, how long a worker may take to end its cut requests (drain.py's 5 s) and let uvicorn
# close its connections (5 s) before the supervisor kills it
_STOP_GRACE_S = 15.0


def main(config: Config) -> None:
    config.gateway.gateway_id = config.gateway.gateway_id or new_id("gw")
    if (config.gateway.workers or 1) > 1:
        run_workers(config)
    else:
        serve(config)


def serve(config: Config, workers: WorkerReadiness | None = None) -> None:
    """One gateway process; uvicorn picks uvloop and httptools (both installed) for its loop and parser.
    `workers`: this worker's slot in the supervisor's readiness flags (run_workers)."""
    settings = config.gateway
    sock = listening_socket(settings.host, settings.port, reuse_port=settings.reuse_port)
    app = build_app(config, workers)
    freeze_startup_heap()
    server_config = uvicorn.Config(
        app,
        log_level=settings.uvicorn_log_level,
        access_log=False,
        backlog=max(2048, settings.max_in_flight),
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=5,  # after our own drain (drain.py) only idle connections are left
    )
    DrainingServer(server_config, app.state.frontend, settings.drain_timeout_s).run(sockets=[sock])


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run_workers(config: Config) -> None:
    """Start `config.gateway.workers` gateways sharing the port and keep that many running: a worker that
    dies is replaced (as uvicorn's and gunicorn's supervisors do), at most max_worker_restarts_per_minute
    times a minute; beyond that the gateway stops and exits non-zero. A signal drains every worker.

    Shutdown is race-free by construction: the signal handler only records the signal; this loop passes
    every recorded signal on to every live worker that has not had it yet (one spawned as the signal came
    in too), spawns nothing once stopping, and gives the workers drain_timeout_s + _STOP_GRACE_S to exit
    before it SIGKILLs the rest and exits non-zero."""
    settings = config.gateway
    context = multiprocessing.get_context("spawn")  # no forked event loops or Redis connections
    metrics_dir = _fresh_metrics_dir()
    received: list[int] = []  # the signals to pass on, in order (appended by the handler only)
    told: dict[multiprocessing.process.BaseProcess, int] = {}  # worker -> how many of `received` it was sent

    def on_signal(signum: int, _: Any) -> None:
        received.append(signum)  # nothing else here: the handler may interrupt this loop anywhere

    signal.signal(signal.SIGTERM, on_signal)  # before the first spawn: no worker is left behind by an early signal
    signal.signal(signal.SIGINT, on_signal)

    ready_flags = context.RawArray("b", settings.workers or 1)  # worker_readiness.py: each worker's own /ready

    def start(index: int) -> multiprocessing.process.BaseProcess:
        ready_flags[index] = 0  # a replacement is not ready until it says so
        worker = context.Process(
            target=_worker, args=(worker_config(config, index), ready_flags, index), name=f"gateway-{index}"
        )
        worker.start()
        return worker

    def pass_signals_on() -> None:
        for worker in workers:
            while worker.pid is not None and told.get(worker, 0) < len(received) and worker.is_alive():
                signum = received[told.get(worker, 0)]
                told[worker] = told.get(worker, 0) + 1
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signum)  # each worker drains on SIGTERM, as one gateway does; a second stops it

    workers = [start(i) for i in range(settings.workers or 1)]
    log.info("gateway: %d workers on %s:%d", len(workers), settings.host, settings.port)
    restarts = RestartBudget(settings.max_worker_restarts_per_minute)
    failed = False
    stop_deadline = float("inf")  # once stopping: when workers still alive are killed
    while True:
        if received and stop_deadline == float("inf"):
            stop_deadline = time.monotonic() + settings.drain_timeout_s + _STOP_GRACE_S
        pass_signals_on()
        live = [w for w in workers if w.is_alive()]
        if received and not live:
            break
        if time.monotonic() >= stop_deadline:
            log.error("gateway workers %s did not exit in time; killing them", [w.pid for w in live])
            for worker in live:
                worker.kill()
                worker.join(timeout=5)
            failed = True
            break
        multiprocessing.connection.wait([w.sentinel for w in live], timeout=0.2)
        for index, worker in enumerate(workers):
            if worker.exitcode is None or worker.pid is None:
                continue
            if worker.pid not in restarts.gone:
                restarts.gone.add(worker.pid)
                ready_flags[index] = 0  # the others answer /ready with 503 until it is replaced and warm
                multiprocess.mark_process_dead(worker.pid, metrics_dir)  # its live gauges stop counting
            if received:  # stopping: a worker that ends now is not replaced
                continue
            if not restarts.allow():
                failed = True  # a crash loop: stop the rest and say so, rather than restart forever
                log.error(
                    "gateway worker %s exited with %s: more than %d restarts in a minute; stopping the gateway",
                    worker.name,
                    worker.exitcode,
                    settings.max_worker_restarts_per_minute,
                )
                received.append(signal.SIGTERM)
                continue
            workers[index] = start(index)  # a signal during the spawn reaches it at the next pass_signals_on
            log.warning(
                "gateway worker %s (pid %s) exited with %s; replaced by pid %s (restart %d in the last minute)",
                worker.name,
                worker.pid,
                worker.exitcode,
                workers[index].pid,
                restarts.recent,
            )
    if failed:
        sys.exit(1)


class RestartBudget:
    """At most `per_minute` restarts in any 60 s window."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self.times: list[float] = []
        self.gone: set[int] = set()  # pids already reported dead

    @property
    def recent(self) -> int:
        return len(self.times)

    def allow(self) -> bool:
        now = time.monotonic()
        self.times = [t for t in self.times if now - t < 60]
        if len(self.times) >= self.per_minute:
            return False
        self.times.append(now)
        return True


def _fresh_metrics_dir() -> str:
    """prometheus-client's multiprocess directory, emptied: /metrics on any worker then sums them all."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or tempfile.mkdtemp(prefix="pagedserve-metrics-")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # the spawned workers inherit it
    return path


def worker_config(config: Config, index: int) -> Config:
    return config.replace(gateway_id=f"{config.gateway.gateway_id}-{index}", workers=1, reuse_port=True)


def _worker(config: Config, ready_flags: Any, index: int) -> None:
    setup_logging("gateway", config.observability.log_level)
    setup_tracing("gateway", console=config.observability.trace_console)
    serve(config, WorkerReadiness(ready_flags, index))
