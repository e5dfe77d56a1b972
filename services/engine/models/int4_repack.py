"""Load-time repacking of 4-bit weights into the layouts the W4A16 kernels read (GPTQ's K-major, then tiled).

    AWQ   qweight [K, N/8] (eight columns per int32)  ->  [K/8, N] (eight rows per int32, nibble i = row 8r + i)
          qzeros  [K/G, N/8] in AWQ's nibble order    ->  sequential nibbles (GPTQ's order; zero offset stays 0)
    GPTQ act order: rows sorted by group (a stable argsort of g_idx), so groups are consecutive again and
          the kernels skip the per-row group lookup; forward gathers x's columns by the same permutation.
    tiled: K-major, but the nibbles interleaved within each tile of TILE_ROWS = 128 inputs, so that nibble i
          of every packed row of a tile belongs to one contiguous slice of 16 inputs:
              packed row 16t + j, nibble i  =  input 128t + 16i + j
          A kernel takes `(packed >> 4i) & 0xF` of a loaded [16, BLOCK_N] tile as a plain [16, BLOCK_N] slice
          (rows 128t + 16i ..) with no reshape: the reshape of [16, 8, N] -> [128, N] that GPTQ's order needs
          costs a shared-memory round trip and barriers in every K step (bench/results/w4a16_tiled_h100/).

Exact (the same codes, zeros and scales, moved), one time, and in row chunks so the unpacked int32 values
of a large linear (4 bytes a weight) never exist at once. The inverse of models/int4.py's unpacking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_CHUNK_ROWS = 512  # unpacked rows held at once (a multiple of 8)
TILE_ROWS = 128  # inputs per interleaved tile of the tiled layout


def _as_int32(packed: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^32) -> the int32 with the same bits."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit values (R % 8 == 0) -> [R/8, N] int32, nibble i of row r <- row 8r + i."""
    shifts = (4 * torch.arange(8, device=values.device, dtype=torch.int64)).view(1, 8, 1)
    return _as_int32((values.to(torch.int64).view(values.shape[0] // 8, 8, -1) << shifts).sum(1))


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit values (N % 8 == 0) -> [R, N/8] int32, nibble j <- column 8c + j (GPTQ's qzeros)."""
    shifts = 4 * torch.arange(8, device=values.device, dtype=torch.int64)
    return _as_int32((values.to(torch.int64).view(values.shape[0], -1, 8) << shifts).sum(-1))


def k_major(rows_of: Callable[[torch.Tensor], torch.Tensor], num_rows: int, num_cols: int) -> torch.Tensor:
    """The [K/8, N] K-major qweight whose row k is `rows_of(ks)` ([len(ks), N] 4-bit values of input rows ks)."""
    out = None
    for start in range(0, num_rows, _CHUNK_ROWS):
        ks = torch.arange(start, min(start + _CHUNK_ROWS, num_rows))
        chunk = rows_of(ks)
        if out is None:
            out = torch.empty((num_rows // 8, num_cols), dtype=torch.int32, device=chunk.device)
        out[start // 8 : start // 8 + chunk.shape[0] // 8] = pack_rows(chunk)
    assert out is not None
    return out


def group_sort(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The row order that makes act order's groups consecutive (row perm[i] is the sorted layout's row i), or
    None when g_idx does not give every group exactly `group_size` rows (then only the GEMM's lookup fits)."""
    perm = torch.argsort(g_idx.long().cpu(), stable=True)
    plain = torch.arange(g_idx.numel()) // group_size
    return perm if torch.equal(g_idx.long().cpu()[perm], plain) else None


def tiled_order(num_rows: int) -> torch.Tensor:
    """The tiled layout as a row order of GPTQ's packing: its K-major row 8r + i holds input order[8r + i]."""
    r, i = torch.arange(num_rows // 8).view(-1, 1), torch.arange(8).view(1, -1)
    return ((r // 16) * TILE_ROWS + 16 * i + r % 16).reshape(-1)


def can_tile(num_rows: int, group_size: int) -> bool:
    """Whole tiles, and every slice of 16 inputs inside one group."""
    return num_rows % TILE_ROWS == 0 and group_size % 16 == 0


def tile_rows(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's K-major qweight [K/8, N] -> the tiled layout (same shape; exact)."""
    order = tiled_order(qweight.shape[0] * 8).to(qweight.device)

    def rows_of(ks: torch.Tensor) -> torch.Tensor:
        rows = order[ks.to(qweight.device)]
        return (qweight[rows // 8] >> (4 * (rows % 8)).to(torch.int32)[:, None]) & 0xF

    return k_major(rows_of, qweight.shape[0] * 8, qweight.shape[1])
