"""4-bit (W4A16) linears split over tensor-parallel ranks, loaded from slices of the checkpoint's packed tensors.

An `Int4Linear` of this rank's shape takes, as `load_piece(param, shard_id, read)`, the rows or columns of each
full checkpoint tensor (GPTQ / AWQ layouts, models/int4.py) that hold its weights:

    column-parallel (q/k/v, gate/up: output columns)    row-parallel (o_proj, down_proj: input rows)
    GPTQ qweight [K/8, N]  columns of the part           rows  K_r/8 (whole int32 words of 8 inputs)
    AWQ  qweight [K, N/8]  packed columns (8 a word)     rows  K_r
    qzeros [G, N/8]        packed columns                rows  K_r/G (whole groups)
    scales [G, N]          columns                       rows  K_r/G
    g_idx [K]              whole                         rows  K_r (the plain k // G, unless act order)

So a split must keep packs of 8 columns and whole groups of inputs, as vLLM requires too. Act order (any input row
in any group): a row-parallel rank keeps every group's scales and zero points and its rows' g_idx.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.services.engine.models.int4 import Int4Linear
from pagedserve.services.engine.parallel.linear import (
    ColumnParallelLinear,
    Part,
    ReadSlice,
    RowParallelLinear,
    RowParallelSum,
    replace_parallel_linears,
    stacked_parts,
)

PACKED_COLUMNS = 8  # AWQ qweight and every qzeros hold eight output columns per int32


def _check_split(linear: str, what: str, part: Part, unit: int) -> None:
    if part.start % unit or part.size % unit:
        raise ValueError(
            f"quantization: {linear} splits its {part.full_size} {what} at {part.start}..{part.start + part.size} "
            f"over tensor-parallel ranks, not in whole units of {unit} (4-bit packs and groups); use a "
            f"tensor_parallel_size that keeps them whole"
        )


class ColumnParallelInt4(Int4Linear):
    """This rank's output columns of one or more stacked checkpoint linears (fused q/k/v, gate/up)."""

    def __init__(self, layer: ColumnParallelLinear, fmt: str, group_size: int, zero_offset: int, name: str) -> None:
        for part in layer.parts.values():
            _check_split(name, "outputs", part, PACKED_COLUMNS)
        offsets = {sid: (local, layer.parts[sid].size) for sid, local in layer.shard_offsets.items()}
        super().__init__(
            layer.in_features,
            layer.out_features,
            layer.bias is not None,
            layer.weight.dtype,
            fmt,
            group_size or layer.in_features,
            zero_offset,
            offsets,
        )
        self.parts = layer.parts

    def _columns(self, param_name: str) -> int:
        """How many output columns one column of the checkpoint tensor holds."""
        packed = param_name == "qzeros" or (param_name == "qweight" and self.fmt == "awq")
        return PACKED_COLUMNS if packed else 1

    def load_piece(self, param_name: str, shard_id: str | None, read: ReadSlice) -> list[str]:
        """This rank's columns of a checkpoint tensor; shard_id None: the tensor stacks every part in order.
        Returns the parameters written."""
        if param_name == "g_idx":  # every rank sees every input
            return self.load_weight("g_idx", read(0, 0, self.in_features), None)
        dim, unit = (0, 1) if param_name == "bias" else (1, self._columns(param_name))
        written: list[str] = []
        for sid, part, start in stacked_parts(self.parts, shard_id):
            written += self.load_weight(param_name, read(dim, start // unit, part.size // unit), sid)
        return written

    def full_pieces(self, param_name: str) -> list[tuple[str | None, tuple[int, ...]]]:
        """(shard id, full shape) of the checkpoint tensor this parameter is cut from (random weights): every part
        stacked, as one GPU's fused linear holds them, so random weights are the same for any number of ranks."""
        if param_name == "g_idx":
            return [(None, (self.in_features,))]
        columns = sum(p.full_size for p in self.parts.values())
        if param_name == "bias":
            return [(None, (columns,))]
        return [(None, (getattr(self, param_name).shape[0], columns // self._columns(param_name)))]


class RowParallelInt4(RowParallelSum, Int4Linear):
    """This rank's input rows; the ranks' products are summed by an all-reduce, the bias added once after it.

    Act order (`act_order`): a row may belong to any group, so the rank keeps every group's scales and zero
    points and its rows' g_idx as the checkpoint has it (as vLLM does); the split then only keeps GPTQ's words of
    8 rows whole."""

    def __init__(
        self, layer: RowParallelLinear, fmt: str, group_size: int, zero_offset: int, name: str, act_order: bool
    ) -> None:
        self.per_channel = group_size == 0  # one group of all K inputs: its scales are every rank's
        self.all_groups = act_order and not self.per_channel
        part = layer.part
        whole_groups = self.per_channel or self.all_groups
        _check_split(name, "inputs", part, PACKED_COLUMNS if whole_groups else math.lcm(group_size, PACKED_COLUMNS))
        super().__init__(
            part.size,
            layer.out_features,
            layer.bias is not None,
            layer.weight.dtype,
            fmt,
            part.size if self.per_channel else group_size,
            zero_offset,
            num_groups=part.full_size // group_size if self.all_groups else None,
        )
        self.ctx, self.part, self.name = layer.ctx, part, name

    def _rows(self, param_name: str) -> tuple[int, int]:
        """(first, count) of this rank's rows of the checkpoint tensor."""
        start, size = self.part.start, self.part.size
        if param_name == "qweight":
            return (start, size) if self.fmt == "awq" else (start // 8, size // 8)
        if self.per_channel:
            return 0, 1
        if self.all_groups:
            return 0, self.part.full_size // self.group_size
        return start // self.group_size, size // self.group_size

    def load_piece(self, param_name: str, shard_id: str | None, read: ReadSlice) -> list[str]:
        """This rank's input rows of a checkpoint tensor; returns the parameters written."""
        if param_name == "bias":
            return self.load_weight("bias", read(0, 0, self.out_features), None)
        if param_name == "g_idx":
            rows = read(0, self.part.start, self.part.size)
            if self.all_groups:  # groups numbered as in the whole tensor: every rank holds every group's scales
                return self.load_weight("g_idx", rows.to(torch.int32), None)
            first = 0 if self.per_channel else self.part.start // self.group_size
            local = rows.to(torch.int32) - first
            if not torch.equal(local.cpu(), self.plain_groups()):
                raise ValueError(
                    f"{self.name}.g_idx: act-order (desc_act) inputs cannot be split over tensor-parallel ranks"
                )
            return self.load_weight("g_idx", local, None)
        return self.load_weight(param_name, read(0, *self._rows(param_name)), None)

    def full_plain_groups(self) -> torch.Tensor:
        """The plain g_idx of all K inputs, which this rank's rows are cut from (random weights)."""
        full_k = self.part.full_size
        return (torch.arange(full_k) // (full_k if self.per_channel else self.group_size)).to(torch.int32)

    def full_pieces(self, param_name: str) -> list[tuple[str | None, tuple[int, ...]]]:
        local = tuple(getattr(self, param_name).shape)
        full_k = self.part.full_size
        if param_name == "g_idx":
            return [(None, (full_k,))]
        if param_name == "bias" or ((self.per_channel or self.all_groups) and param_name != "qweight"):
            return [(None, local)]
        rows = {"qweight": full_k if self.fmt == "awq" else full_k // 8}.get(param_name, full_k // self.group_size)
        return [(None, (rows, *local[1:]))]


def shard_linears_int4(
    model: nn.Module,
    fmt: str,
    group_size: int,
    zero_offset: int,
    keep: Callable[[str], bool] | None = None,
    act_order: bool = False,
) -> int:
    """Swap the sharded decoder's column- and row-parallel linears for 4-bit ones; returns how many. Linears
    `keep` names (full module names) stay in full precision, as on one GPU. group_size 0: per output channel;
    act_order: the checkpoint's g_idx may put any input row in any group."""
    return replace_parallel_linears(
        model,
        lambda name, layer: ColumnParallelInt4(layer, fmt, group_size, zero_offset, name),
        lambda name, layer: RowParallelInt4(layer, fmt, group_size, zero_offset, name, act_order),
        keep,
    )
