"""Mixture-of-experts under tensor parallelism: every rank holds every expert, sliced along the
intermediate dim (rank r: rows [gate_r | up_r] of each w13, the matching columns of each w2).

    rank r:  partial_r = sum_slots weight * W2[e][:, I_r] act(W13[e][gate_r|up_r] x)
    out     = all_reduce(sum_r partial_r)                      one all-reduce per MoE layer

Each expert's MLP is then a column-parallel / row-parallel pair like a dense GatedMLP's; the router
is replicated, so every rank picks the same experts. The fused kernel and the torch path run the
local slice unchanged. (Expert parallelism would split the experts instead; with top-8 of 128 it
needs an all-to-all per layer and balances only on average: not built.)
"""

from __future__ import annotations

import torch

from pagedserve.services.engine.models.moe import Experts
from pagedserve.services.engine.parallel.linear import Part, ReadSlice


class ParallelExperts(Experts):
    def __init__(self, num_experts: int, hidden_size: int, part: Part, activation: str) -> None:
        super().__init__(num_experts, hidden_size, part.size, activation)
        self.part = part  # this rank's slice of the full intermediate dim
        self.hidden_size = hidden_size

    def full_pieces(self, param_name: str) -> list[tuple[str | None, tuple[int, ...]]]:
        """One full tensor per expert and part, as Hub checkpoints store them."""
        full, hidden = self.part.full_size, self.hidden_size
        if param_name == "down_proj":
            return [(f"down:{e}", (hidden, full)) for e in range(self.num_experts)]
        return [(f"{p}:{e}", (full, hidden)) for e in range(self.num_experts) for p in ("gate", "up")]

    def load_piece(self, param_name: str, shard_id: str | None, read: ReadSlice) -> None:
        start, size, full = self.part.start, self.part.size, self.part.full_size
        if shard_id is not None:  # one expert's gate, up [I, hidden] or down [hidden, I]
            part, expert = shard_id.split(":")
            if part == "down":
                self.down_proj.data[int(expert)].copy_(read(1, start, size))
            else:
                self.load_shard(param_name, read(0, start, size), shard_id)
        elif param_name == "gate_up_proj":  # fused 3-D [E, 2I, hidden]: this rank's gate rows, then up rows
            gate, up = read(1, start, size), read(1, full + start, size)
            self.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1))
        else:  # fused 3-D down [E, hidden, I]: the reader slices the first two dims only
            self.down_proj.data.copy_(read(0, 0, self.num_experts).narrow(2, start, size))
