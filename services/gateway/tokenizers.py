"""The gateway's tokenizers, one per served model, loaded once and off the event loop.

Importing transformers and reading a tokenizer take seconds; done on the event loop they would
stall every stream (and time out the Redis reads). Concurrent first requests share one load.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from services.gateway.token_text import TokenTexts
from shared.model_source import resolve_model_dir

_import_lock = threading.Lock()  # transformers' lazy imports fail when two threads race through them


def _load(source: str | None) -> Any:
    with _import_lock:
        from transformers import AutoTokenizer  # imported here, in a worker thread

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(source)))


class TokenizerCache:
    def __init__(self) -> None:
        self._loads: dict[str, asyncio.Task[tuple[Any, TokenTexts]]] = {}

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
        tokenizer = await asyncio.to_thread(_load, source)
        return tokenizer, TokenTexts(tokenizer)
