"""`pagedserve tokenizer`: one tokenizer service process."""

from __future__ import annotations

import asyncio
import logging
import signal

from pagedserve.services.tokenizer.metrics import TokenizerMetrics
from pagedserve.services.tokenizer.processor import PromptProcessor, read_limits
from pagedserve.services.tokenizer.service import TokenizerService
from pagedserve.shared.config import Config
from pagedserve.shared.generation_defaults import read_generation_defaults
from pagedserve.shared.heap import freeze_startup_heap
from pagedserve.shared.ids import new_id
from pagedserve.shared.model_source import model_name_for, resolve_model_dir
from pagedserve.shared.ops_http import serve_ops
from pagedserve.shared.tokenizer_loader import load_tokenizer

log = logging.getLogger(__name__)


def main(config: Config) -> None:
    settings = config.tokenizer
    settings.consumer_name = settings.consumer_name or new_id("tok")
    model_dir = resolve_model_dir(config.model.model)
    model = config.model.served_model_name or model_name_for(config.model.model)
    tokenizer = load_tokenizer(config.model.tokenizer or model_dir, config.model.chat_template)
    defaults = read_generation_defaults(config.model.generation_config, model_dir)
    processor = PromptProcessor(
        tokenizer, read_limits(model_dir, config.model.max_model_len), defaults.get("max_tokens")
    )
    metrics = TokenizerMetrics(model) if settings.metrics_port else None
    service = TokenizerService(config, model, processor, metrics)
    freeze_startup_heap()
    if metrics is not None:
        serve_ops(settings.metrics_port, metrics.registry, service.is_ready, settings.metrics_host)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.stop)
        await service.run()

    asyncio.run(run())
