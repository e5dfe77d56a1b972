"""`pagedserve engine`: one engine replica serving one model."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal

import torch

from pagedserve.services.engine import attention
from pagedserve.services.engine.config import torch_device
from pagedserve.services.engine.engine import Engine
from pagedserve.services.engine.metrics import EngineMetrics
from pagedserve.services.engine.service import EngineService
from pagedserve.shared.config import Config
from pagedserve.shared.heap import freeze_startup_heap
from pagedserve.shared.ids import new_id
from pagedserve.shared.model_source import model_name_for
from pagedserve.shared.ops_http import serve_ops

log = logging.getLogger(__name__)
ENGINE_SECTIONS = ("model", "cache", "scheduler", "runner", "parallel")


def build_engine(config: Config) -> Engine:
    if config.parallel.cpu_threads:
        torch.set_num_threads(config.parallel.cpu_threads)
    device = torch_device(config)
    attention.use_backend(attention.default_backend(device))
    log.info(
        "loading %s on %s (attention: %s, tensor parallel %d)",
        config.model.model or "the default model",
        device,
        attention.backend_name(),
        config.parallel.tensor_parallel_size,
    )
    return Engine(config)


def set_niceness(nice: int) -> None:
    """This process's niceness, before it starts threads or children (they inherit it; on Linux a priority is
    per thread). Lowering it below the current one needs privilege: without, the engine runs as it is."""
    if nice == os.getpriority(os.PRIO_PROCESS, 0):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        log.info("engine niceness %d", nice)
    except PermissionError:
        log.warning(
            "engine_nice %d needs root or CAP_SYS_NICE; running at niceness %d",
            nice,
            os.getpriority(os.PRIO_PROCESS, 0),
        )


def main(config: Config) -> None:
    settings = config.engine
    set_niceness(settings.engine_nice)
    settings.engine_id = settings.engine_id or new_id("eng")
    model = config.model.served_model_name or model_name_for(config.model.model)
    metrics: EngineMetrics | None = None
    services: list[EngineService] = []
    if settings.metrics_port:  # up before the model loads: liveness holds, readiness waits for the service
        metrics = EngineMetrics(model, settings.engine_id)
        serve_ops(
            settings.metrics_port,
            metrics.registry,
            lambda: bool(services) and services[0].is_ready(),
            settings.metrics_host,
        )
        log.info("/metrics, /health and /ready on %s:%d", settings.metrics_host, settings.metrics_port)
    engine = build_engine(config)
    # What this replica runs with, one line an operator (or a test) can read back.
    log.info("engine settings: %s", json.dumps({s: dataclasses.asdict(getattr(config, s)) for s in ENGINE_SECTIONS}))
    service = EngineService(config, model, engine, model_source=config.model.model, metrics=metrics)
    services.append(service)
    freeze_startup_heap()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.serve()
