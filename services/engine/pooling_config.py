"""Whether an engine serves embeddings (pooling) or generates, and how it pools: vLLM's choice, made once.

    --runner generate        text generation (chat, completions); /v1/embeddings gets 400
    --runner pooling         embeddings only: prompts run their forward pass, hidden states are pooled
    --runner auto (default)  pooling when the checkpoint is a sentence-transformers model (modules.json
                             lists a Pooling module) or a bare decoder (`Qwen3Model`: no LM head), else
                             generate
    --pooler-config JSON     {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true}; overrides what
                             the checkpoint says (vLLM's --pooler-config / --override-pooler-config)

Defaults when neither says: LAST pooling (decoder embedding models such as Qwen3-Embedding), normalized.
From a sentence-transformers checkpoint: the mode in `1_Pooling/config.json` (its modules.json path), and
normalize only when modules.json lists a Normalize module (what sentence-transformers itself computes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from pagedserve.services.engine.models.loader import is_bare_decoder
from pagedserve.shared.config import ModelConfig

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[PoolingType, ...] = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling flags -> ours, in the order it checks them
_ST_MODES: tuple[tuple[str, PoolingType], ...] = (
    ("pooling_mode_cls_token", "CLS"),
    ("pooling_mode_mean_tokens", "MEAN"),
    ("pooling_mode_lasttoken", "LAST"),
)


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """How one request is pooled: its model's type and normalization, and the request's own `dimensions`."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True
    dimensions: int | None = None  # Matryoshka: keep the first d components (then normalize)

    @property
    def needs_every_row(self) -> bool:
        """Rows before the last matter: a prefix-cache hit, which computes none of them, cannot serve it."""
        return self.pooling_type != "LAST"

    def validate(self, hidden_size: int) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise ValueError(f"dimensions: must be in [1, {hidden_size}] (the model's hidden size)")


def resolve_pooling(model: ModelConfig, model_dir: Path) -> PoolingParams | None:
    """The engine's pooling (None: it generates), from --runner, --pooler-config and the checkpoint."""
    checkpoint = _sentence_transformers_pooling(model_dir)
    if checkpoint is None and _is_bare_decoder(model_dir):
        checkpoint = {}
    if model.runner == "generate" or (model.runner == "auto" and checkpoint is None):
        return None
    settings: dict[str, Any] = {**(checkpoint or {}), **parse_pooler_config(model.pooler_config)}
    return PoolingParams(pooling_type=settings.get("pooling_type", "LAST"), normalize=settings.get("normalize", True))


def parse_pooler_config(text: str | None) -> dict[str, Any]:
    """--pooler-config as a map with checked values (ValueError naming the key); unknown keys are refused."""
    if not text:
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"pooler_config: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError("pooler_config: must be a JSON object")
    unknown = sorted(set(raw) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config: unsupported keys {unknown} (supported: pooling_type, normalize)")
    settings: dict[str, Any] = {}
    if "pooling_type" in raw:
        kind = str(raw["pooling_type"]).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooler_config: pooling_type {raw['pooling_type']!r} is not one of {POOLING_TYPES}")
        settings["pooling_type"] = cast(PoolingType, kind)
    if "normalize" in raw:
        if not isinstance(raw["normalize"], bool):
            raise ValueError("pooler_config: normalize must be true or false")
        settings["normalize"] = raw["normalize"]
    return settings


def _is_bare_decoder(model_dir: Path) -> bool:
    path = model_dir / "config.json"
    return path.is_file() and is_bare_decoder(json.loads(path.read_text()))


def _sentence_transformers_pooling(model_dir: Path) -> dict[str, Any] | None:
    """What a sentence-transformers checkpoint says (its modules.json with a Pooling module), else None."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    modules = json.loads(path.read_text())
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in types:
        return None
    settings: dict[str, Any] = {"normalize": "Normalize" in types}
    pooling_file = model_dir / str(types["Pooling"].get("path", "")) / "config.json"
    if pooling_file.is_file():
        flags = json.loads(pooling_file.read_text())
        for flag, kind in _ST_MODES:
            if flags.get(flag):
                settings["pooling_type"] = kind
                break
    return settings
