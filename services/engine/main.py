"""`pagedserve engine`: one engine replica serving one model."""

from __future__ import annotations

import logging
import signal

import torch

from services.engine import attention
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.metrics import EngineMetrics
from services.engine.service import EngineService
from shared.model_source import model_name_for, resolve_model_dir
from shared.ops_http import serve_ops
from shared.settings import EngineSettings

log = logging.getLogger(__name__)


def build_engine(settings: EngineSettings) -> Engine:
    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if settings.cpu_threads:
        torch.set_num_threads(settings.cpu_threads)
    attention.use_backend(attention.default_backend(torch.device(device)))
    config = EngineConfig(
        model_dir=str(resolve_model_dir(settings.model)), dtype=settings.dtype, device=device,
        block_size=settings.block_size, num_kv_blocks=settings.num_kv_blocks,
        max_num_seqs=settings.max_num_seqs, max_model_len=settings.max_model_len,
        enable_prefix_caching=settings.enable_prefix_caching,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size, load_format=settings.load_format,
        quantization=settings.quantization, kv_cache_dtype=settings.kv_cache_dtype,
    )
    if settings.max_num_batched_tokens:  # else the engine's default
        config.max_num_batched_tokens = settings.max_num_batched_tokens
    log.info("loading %s on %s (attention: %s, tensor parallel %d)", config.model_dir, device,
             attention.backend_name(), config.tensor_parallel_size)
    return Engine(config)


def main(settings: EngineSettings) -> None:
    model = settings.served_model_name or model_name_for(settings.model)
    metrics: EngineMetrics | None = None
    services: list[EngineService] = []
    if settings.metrics_port:  # up before the model loads: liveness holds, readiness waits for the service
        metrics = EngineMetrics(model, settings.engine_id)
        serve_ops(settings.metrics_port, metrics.registry, lambda: bool(services) and services[0].is_ready())
        log.info("/metrics, /health and /ready on port %d", settings.metrics_port)
    engine = build_engine(settings)
    service = EngineService(settings, model, engine, model_source=settings.model, metrics=metrics)
    services.append(service)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.serve()
