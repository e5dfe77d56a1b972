"""The per-step description of a flattened, ragged batch that every attention backend reads.

It lives in kernels/ (the bottom layer) so the Triton backend needs nothing from the engine above it;
`pagedserve.services.engine.attention` re-exports it for the models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's flattened, ragged batch (see kernels/reference.py)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token's K/V, -1 = padding
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # A hybrid KV cache (services/engine/kv_cache_groups.py): the layers of each sliding window have blocks
    # of their own, so their own slot mapping and block tables (the rest as here). Empty: one group.
    by_window: dict[int, AttentionMetadata] = field(default_factory=dict)

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata a layer with this sliding window (None: global) reads."""
        return self.by_window.get(window, self) if window is not None else self
