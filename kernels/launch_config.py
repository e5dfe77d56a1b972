"""Tile shapes and grid choices for the attention and fused-MoE kernels (pure Python: no triton import).

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
# Decode inner-loop variants (issue 13) the engine uses: AttentionConfig field -> value, e.g.
# {"prefetch": 1, "evict_kv": True}. Empty = the kernel as measured before issue 13. Only a GPU
# sweep (`bench/kernels.py --sweep --only decode`) should change this line.
DECODE_VARIANT: dict[str, int | bool] = {}
# > 0: decode runs as a persistent grid of this many programs per SM (the persistent_programs field).
PERSISTENT_PROGRAMS_PER_SM = 0
# The prefill kernel (kernels/prefill_attention.py) takes a prefill-bucket batch only when its mean query
# length reaches this: a mixed batch that is mostly decodes (2 x 512 + 2 x 512 chunks + 128 decodes has
# mean 16) stays on the paged kernel, which measured 1.06x SDPA on that shape (H100).
PREFILL_KERNEL_MIN_MEAN_QUERY_LEN = 32
# How the prefill kernel loads this step's K/V tiles (its KV_LOAD constexpr is the index).
KV_LOADS = ("pointer", "host_tma", "device_tma")
# Keys per decode tile on a 1-byte (fp8) cache: twice bf16's 64, so each tile load moves the same bytes
# as the tuned bf16 tile. Not yet measured: bench/kernels.py --sweep --only fp8 times it against 64.
FP8_DECODE_TILE_N = 128


# Programmatic dependent launch for the decode chain's kernels (kernels/pdl.py; RunnerConfig.pdl sets it).
_pdl = False


def set_pdl(on: bool) -> None:
    global _pdl
    _pdl = on


def pdl_enabled() -> bool:
    return _pdl


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
    # Variants of the key loop (issue 13); the defaults are the kernel as it was before them.
    prefetch: int = 0  # 1: load the next tile's block ids one iteration early; 2: its K/V too
    loop_stages: int = 0  # > 0: tl.range(num_stages=...) on the full-tile loop (pipelines every load)
    unroll: int = 0  # > 1: loop_unroll_factor of the full-tile loop
    evict_kv: bool = False  # stream K/V with evict_first, keep block-table lines with evict_last
    late_v: bool = False  # issue the V load after QK^T (fewer live registers, later V)
    use_dot: bool = True  # False: scores and P@V as broadcast-multiply + sum (block_m may be < 16)
    persistent_programs: int = 0  # decode-only: > 0 launches this many programs that loop over work

    def block_q(self, num_queries_per_kv: int) -> int:
        """Query tokens per program: the packed rows are (token, head-in-group) pairs."""
        return 1 if self.is_decode_only else max(1, self.block_m // num_queries_per_kv)

    def with_(self, **changes: int | bool) -> AttentionConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def decode_rows_fixed(config: AttentionConfig, group: int) -> AttentionConfig:
    """Without tl.dot there is no 16-row minimum: pad the head group only to a power of two."""
    if config.use_dot:
        return config.with_(block_m=max(config.block_m, MIN_BLOCK_M, next_power_of_2(group)))
    return config.with_(block_m=next_power_of_2(group))


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Compile-time shape of one prefill-kernel launch (each distinct value compiles one kernel variant)."""

    block_m: int  # query rows per program: (block_m // heads_per_program) tokens x heads_per_program
    block_n: int  # keys per inner-loop iteration
    num_warps: int
    num_stages: int
    pack_gqa: bool  # rows hold all query heads of one KV head (else one head per program, like FA2/3)
    kv_load: str = "pointer"  # one of KV_LOADS; TMA needs a power-of-2 head_dim and 16-byte strides
    warp_specialize: bool = False  # tl.range(warp_specialize=True) on the unmasked loop (Triton's autoWS)

    def heads_per_program(self, num_queries_per_kv: int) -> int:
        return num_queries_per_kv if self.pack_gqa else 1

    def block_q(self, num_queries_per_kv: int) -> int:
        """Query tokens per program."""
        return max(1, self.block_m // self.heads_per_program(num_queries_per_kv))

    def with_(self, **changes: int | bool | str) -> PrefillConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def uses_prefill_kernel(*, num_tokens: int, num_seqs: int, max_query_len: int) -> bool:
    """Whether a step whose new K/V are at hand goes to the prefill kernel (host integers only)."""
    return max_query_len >= PREFILL_QUERY_LEN and num_tokens >= PREFILL_KERNEL_MIN_MEAN_QUERY_LEN * num_seqs


def choose_prefill_config(*, num_heads: int, num_kv_heads: int, head_dim: int) -> PrefillConfig:
    """The tilings the H100 sweep (bench/kernels.py --sweep --only prefill) found fastest: K/V tiles through
    a host TMA descriptor in 32-key tiles, 4 stages deep (648 µs; 759 with 64-key pointer loads, on 8 x 2048,
    32/8 d128; Triton's warp specialisation measured 636 but stays off until it has run on more than one
    GPU); at head_dim 64 one head per program and 64-row tiles (31 µs vs 36 with 128 packed rows on
    16 x 512, 9/3). The kernel falls back to pointer loads where TMA cannot take the layout (a head_dim
    that is not a power of 2)."""
    group = num_heads // num_kv_heads
    head_dim_padded = next_power_of_2(head_dim)
    if head_dim_padded > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2, pack_gqa=group > 1)
    if head_dim_padded <= 64:
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, pack_gqa=False, kv_load="host_tma")
    return PrefillConfig(
        block_m=max(128, next_power_of_2(group)),
        block_n=32,
        num_warps=8,
        num_stages=4,
        pack_gqa=group > 1,
        kv_load="host_tma",
    )


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
    group = num_heads // num_kv_heads
    group_rows = max(MIN_BLOCK_M, next_power_of_2(group))
    head_dim_padded = next_power_of_2(head_dim)
    if max_query_len <= 1:
        num_programs = num_seqs * num_kv_heads
        num_segments = 1
        while num_segments < MAX_SEGMENTS and num_programs * num_segments < TARGET_PROGRAMS_PER_SM * num_sms:
            num_segments *= 2
        tile_n = 64 if head_dim_padded <= 128 else 32
        if kv_dtype_bytes == 1 and head_dim_padded <= 128:
            tile_n = FP8_DECODE_TILE_N
        config = AttentionConfig(
            block_m=group_rows,
            tile_n=tile_n,
            num_segments=num_segments,
            num_warps=4,
            num_stages=2 if head_dim_padded <= 64 else 3,
            is_decode_only=True,
        ).with_(**DECODE_VARIANT)
        if num_segments == 1 and head_dim_padded == 128 and kv_dtype_bytes == 2 and not DECODE_VARIANT:
            # One segment per sequence (long loops): prefetching the next tile's block ids lets the K/V loads
            # issue without waiting on the block table; 2 stages then suffice. H100, decode b256 x 1024 32/8:
            # 361.6 vs 376.6 µs. With split-KV (short loops) it measured 1-2% slower, so only here.
            config = config.with_(prefetch=1, num_stages=2)
        if PERSISTENT_PROGRAMS_PER_SM > 0:
            config = config.with_(persistent_programs=PERSISTENT_PROGRAMS_PER_SM * num_sms)
        return decode_rows_fixed(config, group)
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


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Compile-time shape of the fused-MoE grouped GEMMs (kernels/fused_moe.py). Both GEMMs of a layer use
    one config: block_m is also the padding unit of the per-expert row runs (kernels/moe_align.py)."""

    block_m: int  # sorted assignment rows per program (all of one expert)
    block_n: int  # output columns per program (gate_up: per half, so the program covers 2 x block_n rows of w13)
    block_k: int
    group_m: int  # M blocks that walk the N tiles together (L2 reuse of the activations' rows)
    num_warps: int
    num_stages: int


# GPU sweeps (`bench/moe_kernel.py --sweep`) go here: (num_experts, top_k, hidden, intermediate, dtype) ->
# ((largest num_tokens, config), ...) in increasing num_tokens; the last entry serves every larger batch.
MOE_TUNED: dict[tuple[int, int, int, int, str], tuple[tuple[int, MoeConfig], ...]] = {}


def moe_tokens_bucket(num_tokens: int) -> int:
    """Batches that share a bucket share a config (and a compiled kernel): powers of two up to 4096."""
    return min(next_power_of_2(num_tokens), 4096)


def choose_moe_config(
    *, num_experts: int, top_k: int, hidden: int, intermediate: int, num_tokens: int, dtype: str
) -> MoeConfig:
    """A tuned config for this layer shape and batch bucket if a sweep left one, else defaults in the spirit
    of vLLM's: while each expert gets a handful of rows (decode), 16-row blocks waste little on padding and
    wide K tiles stream the weight (the traffic); larger batches fill 64-row blocks and tile for reuse."""
    bucket = moe_tokens_bucket(num_tokens)
    tuned = MOE_TUNED.get((num_experts, top_k, hidden, intermediate, dtype))
    if tuned:
        return next((config for max_tokens, config in tuned if bucket <= max_tokens), tuned[-1][1])
    rows_per_expert = bucket * top_k / num_experts
    if rows_per_expert <= 8:
        return MoeConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if rows_per_expert <= 32:
        return MoeConfig(block_m=32, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if rows_per_expert <= 128:
        return MoeConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)
    # Prefill-sized: 128 x 128 tiles. H100 sweep, Qwen3-30B-A3B layer at 4096 tokens (256 rows per expert):
    # 1024 µs vs 1244 with the 64 x 64 tiles above (bench/results/moe_kernel_h100/sweep.log).
    return MoeConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


def split_k(num_programs: int, k: int, min_slice: int, target: int) -> int:
    """Slices of K for a split-K GEMM/GEMV grid: doubled while the grid has fewer than `target` programs and
    each slice keeps at least `min_slice` inputs (a power of two; 1 = no split)."""
    split = 1
    while num_programs * split < target and k // (split * 2) >= min_slice:
        split *= 2
    return split
