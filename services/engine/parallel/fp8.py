"""FP8 linears split over tensor-parallel ranks: an `Fp8Linear` of this rank's shape, loaded from slices.

    column-parallel (q/k/v, gate/up)      weight [N, K]: the part's rows;  weight_scale [N]: the same rows
    row-parallel (o_proj, down_proj)      weight [N, K]: the part's input columns;  weight_scale [N]: whole

A per-tensor scale reads as that value on every row (parallel/loading.py's stream reader), so fused q/k/v with
three scales split exactly. Weights quantised at load (`--quantization fp8` on a bf16 checkpoint) take one
scale per row of this rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pagedserve.services.engine.models.fp8 import Fp8Linear
from pagedserve.services.engine.parallel.linear import (
    ColumnParallelLinear,
    ReadSlice,
    RowParallelLinear,
    RowParallelSum,
    replace_parallel_linears,
    stacked_parts,
)


class ColumnParallelFp8(Fp8Linear):
    """This rank's output rows of one or more stacked checkpoint linears (fused q/k/v, gate/up)."""

    def __init__(self, layer: ColumnParallelLinear) -> None:
        offsets = {sid: (local, layer.parts[sid].size) for sid, local in layer.shard_offsets.items()}
        super().__init__(layer.in_features, layer.out_features, layer.bias is not None, layer.weight.dtype, offsets)
        self.parts = layer.parts

    def load_piece(self, param_name: str, shard_id: str | None, read: ReadSlice) -> list[str]:
        """This rank's rows of a checkpoint tensor; shard_id None: the tensor stacks every part in order."""
        written: list[str] = []
        for sid, part, start in stacked_parts(self.parts, shard_id):
            written += self.load_weight(param_name, read(0, start, part.size), sid)
        return written

    def full_pieces(self, param_name: str) -> list[tuple[str | None, tuple[int, ...]]]:
        """(shard id, full shape) of the checkpoint tensor this parameter is cut from (random weights)."""
        rows = sum(p.full_size for p in self.parts.values())
        return [(None, (rows, *getattr(self, param_name).shape[1:]))]


class RowParallelFp8(RowParallelSum, Fp8Linear):
    """This rank's input columns; the ranks' products are summed by an all-reduce, the bias added once after."""

    def __init__(self, layer: RowParallelLinear) -> None:
        super().__init__(layer.part.size, layer.out_features, layer.bias is not None, layer.weight.dtype)
        self.ctx, self.part = layer.ctx, layer.part

    def load_piece(self, param_name: str, shard_id: str | None, read: ReadSlice) -> list[str]:
        if param_name == "weight":
            return self.load_weight("weight", read(1, self.part.start, self.part.size), None)
        return self.load_weight(param_name, read(0, 0, self.out_features), None)

    def full_pieces(self, param_name: str) -> list[tuple[str | None, tuple[int, ...]]]:
        shape = tuple(getattr(self, param_name).shape)
        return [(None, (shape[0], self.part.full_size) if param_name == "weight" else shape)]


def shard_linears_fp8(model: nn.Module, keep: Callable[[str], bool] | None = None) -> int:
    """Swap the sharded decoder's column- and row-parallel linears for FP8 ones; returns how many. Linears `keep`
    names (what an FP8 checkpoint left unquantized) stay in full precision."""
    return replace_parallel_linears(
        model, lambda _, layer: ColumnParallelFp8(layer), lambda _, layer: RowParallelFp8(layer), keep
    )
