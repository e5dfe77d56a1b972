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

from collections.abc import Callable

import torch

from pagedserve.services.engine.models.moe import Experts
from pagedserve.services.engine.models.quantized_experts import Fp8Experts, Int4Experts
from pagedserve.services.engine.parallel.linear import Part, ReadSlice, even_part
from pagedserve.services.engine.parallel.state import ParallelContext


class _IntermediateSlice:
    """An experts module holding this rank's `part` of the full intermediate dim, and the full per-expert
    checkpoint tensors its parameters come from."""

    part: Part
    hidden_size: int
    num_experts: int

    def _full_columns(self, param_name: str) -> int:
        """Columns of one expert's full down tensor `param_name`: inputs, int4 codes, groups, or 1 (an int4
        per-channel group)."""
        if param_name != "down_proj" and getattr(self, "group_size", None) == 0:
            return 1
        return getattr(self, param_name).shape[2] * self.part.full_size // self.part.size

    def full_pieces(self, param_name: str) -> list[tuple[str | None, tuple[int, ...]]]:
        """One full tensor per expert and part, as Hub checkpoints store them."""
        local = getattr(self, param_name)
        experts = range(self.num_experts)
        if param_name.startswith("down_proj"):
            shape = (self.hidden_size,) if local.dim() == 2 else (self.hidden_size, self._full_columns(param_name))
            return [(f"down:{e}", shape) for e in experts]
        shape = (self.part.full_size, *local.shape[2:])
        return [(f"{p}:{e}", shape) for e in experts for p in ("gate", "up")]


class ParallelExperts(_IntermediateSlice, Experts):
    def __init__(self, num_experts: int, hidden_size: int, part: Part, activation: str) -> None:
        super().__init__(num_experts, hidden_size, part.size, activation)
        self.part = part  # this rank's slice of the full intermediate dim
        self.hidden_size = hidden_size

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


class _QuantizedSlices(_IntermediateSlice):
    """Quantized experts (fp8, int4) under tensor parallelism, sliced as ParallelExperts slices dense ones: this
    rank's gate and up rows of each expert with their scales (and zero points), and its intermediate columns of
    each down weight: its codes (two a byte for int4), its groups' scales and zero points (all ranks share a
    per-channel group's), and the whole per-row fp8 down scale. Each full checkpoint tensor is cut to this
    rank's piece, then loaded by the quantized experts' own `load_weight` (kernel layout, fp8 scale forms).
    The fused-MoE kernel and the torch paths run the local experts unchanged."""

    load_weight: Callable[[str, torch.Tensor, str | None], list[str]]

    def load_piece(self, param_name: str, shard_id: str | None, read: ReadSlice) -> list[str]:
        start, size, full = self.part.start, self.part.size, self.part.full_size
        local = getattr(self, param_name)
        down = param_name.startswith("down_proj")
        if shard_id is None:  # a fused tensor of every expert [E, rows, ...], or one scale an expert [E]
            loaded = read(0, 0, self.num_experts)
            if down and local.dim() == 3 and loaded.dim() == 3:
                loaded = self._columns(loaded, param_name, 2)
            elif not down and loaded.dim() >= 2 and loaded.shape[1] == 2 * full:  # this rank's gate rows, up rows
                loaded = torch.cat([loaded[:, start : start + size], loaded[:, full + start : full + start + size]], 1)
        elif not down:  # one expert's gate or up rows, or their scales / zero points
            loaded = read(0, start, size)
        elif local.dim() == 2:  # fp8's per-row down scale: every row of hidden
            loaded = read(0, 0, self.hidden_size)
        else:
            loaded = self._columns(read(0, 0, self.hidden_size), param_name, 1)
        return self.load_weight(param_name, loaded, shard_id)

    def _columns(self, tensor: torch.Tensor, param_name: str, dim: int) -> torch.Tensor:
        """This rank's intermediate columns of a down tensor along `dim` (a per-tensor scale, or the one group of
        a per-channel int4 weight, as it is)."""
        columns, full = self._full_columns(param_name), self.part.full_size
        if tensor.dim() <= dim or columns == 1:
            return tensor
        if tensor.shape[dim] != columns:
            raise ValueError(f"{param_name}: {tensor.shape[dim]} columns where {columns} were expected")
        return tensor.narrow(dim, self.part.start * columns // full, self.part.size * columns // full)


class ParallelFp8Experts(_QuantizedSlices, Fp8Experts):
    def __init__(self, num_experts: int, hidden_size: int, part: Part, activation: str) -> None:
        super().__init__(num_experts, hidden_size, part.size, activation)
        self.part, self.hidden_size = part, hidden_size


class ParallelInt4Experts(_QuantizedSlices, Int4Experts):
    def __init__(self, num_experts: int, hidden_size: int, part: Part, activation: str, group_size: int) -> None:
        super().__init__(num_experts, hidden_size, part.size, activation, group_size)
        self.part, self.hidden_size = part, hidden_size


def parallel_experts(experts: Experts, hidden_size: int, ctx: ParallelContext) -> Experts:
    """This rank's experts: dense ones sliced (ParallelExperts), quantized ones kept quantized and sliced at
    whole groups (and whole bytes of int4 codes)."""
    if isinstance(experts, Int4Experts):
        part = even_part(experts.intermediate_size, ctx, unit=experts.group_size or 2)
        return ParallelInt4Experts(experts.num_experts, hidden_size, part, experts.activation, experts.group_size)
    part = even_part(experts.intermediate_size, ctx)
    if isinstance(experts, Fp8Experts):
        return ParallelFp8Experts(experts.num_experts, hidden_size, part, experts.activation)
    return ParallelExperts(experts.num_experts, hidden_size, part, experts.activation)
