"""Column- and row-parallel linear layers (Megatron-style), loaded from slices of full tensors.

    column: y_r = x @ W[rows of rank r]^T          output features split; no communication
    row:    y   = sum_r x[:, cols r] @ W[:, cols r]^T  (one all-reduce), bias added once after it

A column layer may stack several checkpoint tensors (fused q/k/v, gate/up); each is split on its
own, so rank r's weight is [q_r | k_r | v_r] (see `attention_parts` for how heads are split).

Loading: `load_piece(param, shard_id, read)` where `read(dim, start, size)` returns that slice of
the full checkpoint tensor, so a safetensors file is read only where this rank needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedserve.services.engine import dense
from pagedserve.services.engine.models.layers import replace_decoder_linears
from pagedserve.services.engine.parallel.state import ParallelContext

ReadSlice = Callable[[int, int, int], torch.Tensor]  # (dim, start, size) -> that slice of the full tensor


@dataclass(frozen=True, slots=True)
class Part:
    """This rank's rows of one full checkpoint tensor of `full_size` rows."""

    full_size: int
    start: int
    size: int


def even_part(full_size: int, ctx: ParallelContext, unit: int = 1) -> Part:
    """A balanced split in whole `unit`s (sizes differ by at most one unit when it does not divide)."""
    num_units, world, rank = full_size // unit, ctx.world_size, ctx.rank
    start, end = rank * num_units // world, (rank + 1) * num_units // world
    return Part(full_size, start * unit, (end - start) * unit)


def attention_parts(num_heads: int, num_kv_heads: int, head_dim: int, ctx: ParallelContext) -> tuple[Part, Part]:
    """This rank's query-head and KV-head rows. Query heads follow their KV head's group:

    KV heads >= ranks: KV heads split (unevenly if need be, e.g. SmolLM2's 3 over 2 ranks: 2 + 1),
                       each rank takes the query heads of its KV heads
    KV heads <  ranks: each KV head replicated on ranks / num_kv_heads consecutive ranks, which
                       split that head's query group (Falcon multi-query; 8 KV heads on 16 ranks)
    """
    world, rank = ctx.world_size, ctx.rank
    group = num_heads // num_kv_heads
    if num_heads < world:
        raise ValueError(f"tensor_parallel_size: {num_heads} attention heads cannot be split over {world} ranks")
    if num_kv_heads >= world:
        kv_first, kv_end = rank * num_kv_heads // world, (rank + 1) * num_kv_heads // world
        q_first, q_end = kv_first * group, kv_end * group
    else:
        if world % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size: {num_kv_heads} KV heads cannot be replicated evenly over {world} ranks"
            )
        ranks_per_kv = world // num_kv_heads
        kv_first, kv_end = rank // ranks_per_kv, rank // ranks_per_kv + 1
        sub = rank % ranks_per_kv
        q_first = kv_first * group + sub * group // ranks_per_kv
        q_end = kv_first * group + (sub + 1) * group // ranks_per_kv
    q = Part(num_heads * head_dim, q_first * head_dim, (q_end - q_first) * head_dim)
    kv = Part(num_kv_heads * head_dim, kv_first * head_dim, (kv_end - kv_first) * head_dim)
    return q, kv


def stacked_parts(parts: dict[str, Part], shard_id: str | None) -> Iterator[tuple[str, Part, int]]:
    """(shard id, part, this rank's first row in the checkpoint tensor) of each part a column-parallel layer
    takes from one checkpoint tensor: the part `shard_id` names, or (None) every part, stacked in order."""
    base = 0
    for sid, part in parts.items():
        if shard_id is None or sid == shard_id:
            yield sid, part, (base if shard_id is None else 0) + part.start
        base += part.full_size


@dense.plain_linear
class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, parts: dict[str, Part], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = parts
        self.shard_offsets: dict[str, int] = {}  # shard id -> first local row
        offset = 0
        for shard_id, part in parts.items():
            self.shard_offsets[shard_id] = offset
            offset += part.size
        self.out_features = offset
        self.weight = nn.Parameter(torch.empty(offset, in_features))
        self.bias = nn.Parameter(torch.empty(offset)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, self.weight, self.bias)

    def full_pieces(self, param_name: str) -> list[tuple[str | None, tuple[int, ...]]]:
        """(shard id, full shape) of each checkpoint tensor this parameter is cut from."""
        rest = (self.in_features,) if param_name == "weight" else ()
        return [(sid, (p.full_size, *rest)) for sid, p in self.parts.items()]

    def load_piece(self, param_name: str, shard_id: str | None, read: ReadSlice) -> None:
        """Copy this rank's rows; shard_id None: the full tensor stacks every shard in order."""
        param = self.weight if param_name == "weight" else self.bias
        assert param is not None
        for sid, part, start in stacked_parts(self.parts, shard_id):
            local = self.shard_offsets[sid]
            param.data[local : local + part.size].copy_(read(0, start, part.size))


class RowParallelSum:
    """What a row-parallel layer (full precision, 4-bit, FP8) does with its `product` (x times this rank's input
    rows, without the bias): all-reduce it and add the bias once, after; or, where the symmetric buffer takes it,
    write it there for `fused_ops.add_rms_norm` to sum (parallel/partial_sums.py)."""

    ctx: ParallelContext
    out_features: int
    bias: nn.Parameter | None

    if TYPE_CHECKING:  # each layer's own (a mixin's stub would shadow it at run time)

        def product(self, x: torch.Tensor) -> torch.Tensor: ...

    def product_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The product written into `out`: a copy, unless the layer writes there itself."""
        return out.copy_(self.product(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.ctx.all_reduce(self.product(x))
        return out if self.bias is None else out + self.bias

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's addend, written into the symmetric buffer; the reduced output where it cannot take it."""
        partials = self.ctx.partials
        num_rows = x.shape[0]
        if (
            partials is None
            or self.bias is not None
            or x.dim() != 2
            or not partials.fits(num_rows, self.out_features, x.dtype)
        ):
            return self.forward(x)
        return self.product_into(x, partials.slot(num_rows, self.out_features, x.dtype))


class RowParallelLinear(RowParallelSum, nn.Module):
    def __init__(self, part: Part, out_features: int, bias: bool, ctx: ParallelContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.part = part  # this rank's input features (the column layer before it produced them)
        in_features = part.full_size
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.part.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, self.weight)

    def product_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, self.weight, out=out)

    def full_pieces(self, param_name: str) -> list[tuple[str | None, tuple[int, ...]]]:
        full = (self.out_features, self.in_features) if param_name == "weight" else (self.out_features,)
        return [(None, full)]

    def load_piece(self, param_name: str, shard_id: str | None, read: ReadSlice) -> None:
        if param_name == "weight":
            self.weight.data.copy_(read(1, self.part.start, self.part.size))
        else:
            assert self.bias is not None
            self.bias.data.copy_(read(0, 0, self.out_features))


def replace_parallel_linears(
    model: nn.Module,
    column: Callable[[str, ColumnParallelLinear], nn.Module],
    row: Callable[[str, RowParallelLinear], nn.Module],
    keep: Callable[[str], bool] | None = None,
) -> int:
    """Swap the sharded decoder's column- and row-parallel linears for `column(name, layer)` / `row(name, layer)`
    (a quantized layer, built on meta before loading), as `replace_decoder_linears` swaps a one-GPU model's;
    returns how many."""

    def make(name: str, layer: ColumnParallelLinear | RowParallelLinear) -> nn.Module:
        with torch.device("meta"):
            return column(name, layer) if isinstance(layer, ColumnParallelLinear) else row(name, layer)

    return replace_decoder_linears(model, make, keep, kinds=(ColumnParallelLinear, RowParallelLinear))
