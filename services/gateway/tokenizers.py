"""The gateway's tokenizers, one per served model, loaded once and off the event loop.

Importing transformers and reading a tokenizer take seconds; done on the event loop they would
stall every stream (and time out the Redis reads). Concurrent first requests share one load.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedserve.services.gateway.token_text import TokenTexts
from pagedserve.shared.config import ModelConfig
from pagedserve.shared.tokenizer_loader import load_tokenizer


class TokenizerCache:
    def __init__(self, model_config: ModelConfig | None = None) -> None:
        self._loads: dict[str, asyncio.Task[tuple[Any, TokenTexts]]] = {}
        self.model_config = model_config or ModelConfig()  # --chat-template applies to the configured model

    def has(self, model: str) -> bool:
        task = self._loads.get(model)
        return task is not None and task.done() and task.exception() is None

    def is_loading(self, model: str) -> bool:
        task = self._loads.get(model)
        return task is not None and not task.done()

    async def get(self, model: str, source: str | None) -> tuple[Any, TokenTexts]:
        """`model`'s tokenizer (from `source`, what its engines loaded) and its token texts."""
        task = self._loads.get(model)
        if task is None or (task.done() and task.exception() is not None):  # first use, or retry a failure
            task = self._loads[model] = asyncio.get_running_loop().create_task(self._load(source))
        return await asyncio.shield(task)  # a cancelled request must not cancel a shared load

    async def _load(self, source: str | None) -> tuple[Any, TokenTexts]:
        configured = self.model_config
        if source == configured.model:  # the model this process was configured with: its --tokenizer/--chat-template
            load = (configured.tokenizer or source, configured.chat_template)
        else:
            load = (source, None)
        tokenizer = await asyncio.to_thread(load_tokenizer, *load)
        return tokenizer, TokenTexts(tokenizer)
