"""`pagedserve engine`: one engine replica serving one model."""

from __future__ import annotations

import logging
import signal

import torch

from services.engine import attention
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.service import EngineService
from shared.model_source import model_name_for, resolve_model_dir
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
        tensor_parallel_size=settings.tensor_parallel_size,
        quantization=settings.quantization, kv_cache_dtype=settings.kv_cache_dtype,
    )
    if settings.max_num_batched_tokens:  # else the engine's default
        config.max_num_batched_tokens = settings.max_num_batched_tokens
    log.info("loading %s on %s (attention: %s, tensor parallel %d)", config.model_dir, device,
             attention.backend_name(), config.tensor_parallel_size)
    return Engine(config)


def main(settings: EngineSettings) -> None:
    engine = build_engine(settings)
    model = settings.served_model_name or model_name_for(settings.model)
    service = EngineService(settings, model, engine, model_source=settings.model)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.serve()
