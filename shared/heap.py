"""Start-up objects out of the garbage collector's way."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (imports, the tokenizer's vocabulary, the model's modules)
    into the permanent generation, where later full collections do not walk them. Call once a service has loaded
    what it serves. In a CPU probe, full collections over such a heap stalled a tokenizer for a few hundred ms in
    a burst of 256 requests (tokenizer CPU burst: 604 ms with them, ~250 ms without)."""
    gc.collect()
    gc.freeze()
