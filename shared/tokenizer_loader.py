"""The one way every service loads a model's Hugging Face tokenizer: from the checkpoint (or `--tokenizer`),
with `--chat-template` (inline Jinja or a file) in place of the checkpoint's own template.

transformers is imported on first use: importing it takes seconds, and a process that never tokenizes
(a gateway with nothing to detokenize yet) should not pay for it at start.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from pagedserve.shared.model_source import resolve_model_dir

_import_lock = threading.Lock()  # transformers' lazy imports fail when two threads race through them


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's text, or the value itself (an inline template)."""
    if not value:
        return None
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    return value


def load_tokenizer(source: str | Path | None, chat_template: str | None = None) -> Any:
    """The tokenizer of `source` (a model name, directory, .gguf or hub id; None: the default model)."""
    with _import_lock:
        from transformers import AutoTokenizer

    # A directory is taken as it is (a tokenizer-only folder has no config.json); anything else is resolved.
    is_dir = source is not None and Path(source).is_dir()
    directory = source if is_dir else resolve_model_dir(str(source) if source is not None else None)
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    template = read_chat_template(chat_template)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer
