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
    # A hybrid KV cache (services/engine/kv_cache_groups.py): each layer's group's metadata (its own slot
    # mapping and block tables, the rest as here), by layer. Empty: one group, every layer reads this.
    by_layer: list[AttentionMetadata] = field(default_factory=list)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` attends with."""
        return self.by_layer[layer] if self.by_layer else self

    def with_groups(self, group_tables: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: list[int]) -> None:
        """Give each layer its group's metadata: group 0 is this one, group g >= 1 has `group_tables[g - 1]`
        (slot mapping, block tables)."""
        if not group_tables:
            return
        metas = [self] + [
            AttentionMetadata(slots, self.query_start_loc, self.seq_lens, tables, self.max_query_len, self.max_seq_len)
            for slots, tables in group_tables
        ]
        self.by_layer = [metas[g] for g in layer_groups]
