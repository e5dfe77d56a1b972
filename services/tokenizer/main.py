"""`pagedserve tokenizer`: one tokenizer service process."""

from __future__ import annotations

import asyncio
import logging
import signal

from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.processor import PromptProcessor, read_limits
from services.tokenizer.service import TokenizerService
from shared.model_source import model_name_for, resolve_model_dir
from shared.ops_http import serve_ops
from shared.settings import TokenizerSettings

log = logging.getLogger(__name__)


def main(settings: TokenizerSettings) -> None:
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(settings.model)
    model = settings.served_model_name or model_name_for(settings.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor = PromptProcessor(tokenizer, read_limits(model_dir, settings.max_model_len))
    metrics = TokenizerMetrics(model) if settings.metrics_port else None
    service = TokenizerService(settings, model, processor, metrics)
    if metrics is not None:
        serve_ops(settings.metrics_port, metrics.registry, service.is_ready)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.stop)
        await service.run()

    asyncio.run(run())
