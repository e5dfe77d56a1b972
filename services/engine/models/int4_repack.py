"""Load-time repacking of 4-bit weights into the one layout the decode GEMV reads (GPTQ's, K-major).

    AWQ   qweight [K, N/8] (eight columns per int32)  ->  [K/8, N] (eight rows per int32, nibble i = row 8r + i)
          qzeros  [K/G, N/8] in AWQ's nibble order    ->  sequential nibbles (GPTQ's order; zero offset stays 0)
    GPTQ act order: rows sorted by group (a stable argsort of g_idx), so groups are consecutive again and
          the kernels skip the per-row group lookup; forward gathers x's columns by the same permutation.

Exact (the same codes, zeros and scales, moved), one time, and in row chunks so the unpacked int32 values
of a large linear (4 bytes a weight) never exist at once. The inverse of models/int4.py's unpacking.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_CHUNK_ROWS = 512  # unpacked rows held at once (a multiple of 8)


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
