"""Tile shapes and grid choices for the paged-attention kernel (pure Python: no triton import).

Everything here is a function of host integers the model runner already has, never of tensor
contents, so a step never syncs with the GPU and a CUDA graph captured for one batch shape replays
with the same grid. What must stay fixed between capture and replay:

    num_tokens (query.shape[0]), num_seqs (seq_lens.shape[0]), block_tables.shape,
    whether the batch is decode-only (max_query_len == 1), and the max_query_len bucket below.

`max_seq_len` is deliberately NOT an input: split-KV segments are sized inside the kernel from each
sequence's own length, so a decode graph stays valid while contexts grow.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Query rows (tokens x packed heads) per program: tl.dot wants M >= 16.
MIN_BLOCK_M = 16
# max_query_len at or above which a batch counts as prefill-heavy and gets 64-row tiles.
PREFILL_QUERY_LEN = 64
# Split-KV (decode-only batches) doubles the segments until the grid has this many programs per SM:
# on an H200 that picked the fastest split measured for 64 x 8, 256 x 8 and 32 x 3 programs.
TARGET_PROGRAMS_PER_SM = 4
MAX_SEGMENTS = 16
# Keys per decode tile on a 1-byte (fp8) cache: twice bf16's 64, so each tile load moves the same bytes
# as the tuned bf16 tile. Not yet measured: bench/kernels.py --sweep --only fp8 times it against 64.
FP8_DECODE_TILE_N = 128


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Compile-time shape of one launch (each distinct value compiles one kernel variant)."""

    block_m: int  # query rows per program = block_q tokens x num_queries_per_kv heads (padded)
    tile_n: int  # keys per inner-loop iteration (any multiple of 16; may span several cache blocks)
    num_segments: int  # split-KV segments per sequence (1 = write the output directly)
    num_warps: int
    num_stages: int
    is_decode_only: bool  # one program per sequence, no sequence search

    def block_q(self, num_queries_per_kv: int) -> int:
        """Query tokens per program: the packed rows are (token, head-in-group) pairs."""
        return 1 if self.is_decode_only else max(1, self.block_m // num_queries_per_kv)

    def with_(self, **changes: int | bool) -> AttentionConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def choose_config(
    *,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    num_sms: int,
    kv_dtype_bytes: int = 2,
) -> AttentionConfig:
    """Pick tiles for one step; decode-only batches may split the KV range (flash-decoding).

    Mixed batches use one launch: a second, decode-shaped launch for their single-token sequences
    measured slower on an H200 (the two launches serialise), so decodes ride in the query tiles.
    """
    group_rows = max(MIN_BLOCK_M, next_power_of_2(num_heads // num_kv_heads))
    head_dim_padded = next_power_of_2(head_dim)
    if max_query_len <= 1:
        num_programs = num_seqs * num_kv_heads
        num_segments = 1
        while num_segments < MAX_SEGMENTS and num_programs * num_segments < TARGET_PROGRAMS_PER_SM * num_sms:
            num_segments *= 2
        tile_n = 64 if head_dim_padded <= 128 else 32
        if kv_dtype_bytes == 1 and head_dim_padded <= 128:
            tile_n = FP8_DECODE_TILE_N
        return AttentionConfig(
            block_m=group_rows,
            tile_n=tile_n,
            num_segments=num_segments,
            num_warps=4,
            num_stages=2 if head_dim_padded <= 64 else 3,
            is_decode_only=True,
        )
    if max_query_len >= PREFILL_QUERY_LEN:
        # 64 rows x 4 warps x 2 stages was the fastest tiling measured for prefill and mixed (H200).
        return AttentionConfig(
            block_m=max(64, group_rows),
            tile_n=64 if head_dim_padded <= 128 else 32,
            num_segments=1,
            num_warps=4 if head_dim_padded <= 128 else 8,  # 4 warps spill at head_dim 256
            num_stages=2,
            is_decode_only=False,
        )
    # Short queries (speculative / small chunks): a few tokens per program.
    return AttentionConfig(
        block_m=max(32, group_rows),
        tile_n=64 if head_dim_padded <= 128 else 32,
        num_segments=1,
        num_warps=4,
        num_stages=3,
        is_decode_only=False,
    )
