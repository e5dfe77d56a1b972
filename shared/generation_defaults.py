"""Sampling defaults from a checkpoint's generation_config.json (`--generation-config`), as vLLM does.

`auto` reads the model folder's generation_config.json, `vllm` uses none, any other value is a folder
holding one. Like vLLM's ModelConfig.get_diff_sampling_param, only temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (as max_tokens) count, and only values that differ from
transformers' GenerationConfig defaults (vLLM reads the file through `to_diff_dict`, so e.g. top_k 50
is no default). `do_sample` is ignored, as in vLLM.

A default fills a field only where the request left it out: the gateway omits unset sampling fields
from the wire dict (schemas.sampling_dict). The engine fills them on every replica (so a request moved
to another replica samples the same way); the tokenizer fills max_tokens, which it resolves.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # the engine fills these
_HF_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
    "max_new_tokens": None,
}
_FILE = "generation_config.json"


def read_generation_defaults(setting: str, model_dir: Path | str | None) -> dict[str, Any]:
    """The defaults `--generation-config setting` gives (vLLM names: max_new_tokens becomes max_tokens)."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if model_dir is None:
            return {}
        folder = Path(model_dir)
    else:
        folder = Path(setting)
        if not folder.is_dir():  # an operator's typo should not silently serve with other sampling
            raise ValueError(f"--generation-config {setting!r}: not a folder (auto, vllm or a folder holding {_FILE})")
    path = folder / _FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("%s not read, no sampling defaults from it: %s", path, exc)
        return {}
    defaults = {}
    for name, hf_default in _HF_DEFAULTS.items():
        value = config.get(name) if isinstance(config, dict) else None
        if value is None or value == hf_default or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if name == "max_new_tokens" and not (isinstance(value, int) and value > 0):
            continue
        defaults["max_tokens" if name == "max_new_tokens" else name] = value
    if defaults:
        log.warning(
            "sampling defaults from %s for fields a request omits: %s (--generation-config vllm turns them off)",
            path,
            defaults,
        )
    return defaults


def fill_sampling(sampling: Mapping[str, Any], defaults: dict[str, Any]) -> Mapping[str, Any]:
    """`sampling` with the defaults of the sampling fields it leaves out (max_tokens is the tokenizer's)."""
    missing = {name: defaults[name] for name in SAMPLING_FIELDS if name in defaults and name not in sampling}
    return {**sampling, **missing} if missing else sampling
