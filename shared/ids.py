"""Process ids: a gateway, engine or tokenizer without a configured id takes a new random one at start."""

from __future__ import annotations

import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
