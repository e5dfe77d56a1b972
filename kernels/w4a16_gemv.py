"""W4A16 GEMV for decode (one row): y = x @ dequant(W), W in the tiled 4-bit layout, no tl.dot.

tl.dot's smallest tile has 16 rows, so at M = 1 the GEMM (kernels/w4a16_gemm.py) pays for 16x the products.
Here each program owns BLOCK_N output columns and a slice of K; every weight is unpacked once and multiplied
by x on the CUDA cores, with the zero point and scale folded out of the inner loop (one group per slice of 16):

    sum_{k in g} x[m,k] s[g,n] (q[k,n] - z[g,n])  =  s[g,n] (sum_{k in g} x[m,k] q[k,n] - z[g,n] sum_{k in g} x[m,k])

    qweight [K/8, N] int32, tiled (services/engine/models/int4_repack.py): packed row 16t + j, nibble i holds
    input 128t + 16i + j.  program (n-tile, k-slice), per tile t of 128 inputs:
        packed = qweight[16t + h : 16t + h + ROWS, n-tile]   (h = 0, ROWS, ..)   coalesced [ROWS, BLOCK_N] loads
        for i in 0..7:  acc2 += x[128t + 16i + h : +ROWS, None] * (b_i + nibble i of packed)   FMAs, no reshape
        acc += s * (sum(acc2, axis 0) - sum_i b_i sum(x_i) - z * sum(x of the tile))   (per slice when G < 128)

The codes become floats bias + q by bit operations, two at a time (_biased_pair), and the biases leave with the
zero point.

With BLOCK_N = 4 x 32 x num_warps a thread holds all ROWS rows of its columns: the row sums stay in registers
and the loop has no shared memory and no barrier (GPTQ's own order needed a [16, 8, N] -> [128, N] reshape, a
shared-memory round trip in every K step). ROWS = 8, half a tile at a time, keeps half the tile's x live: 128
registers a thread (ptxas for sm_90, with split-K and prefetch, Triton 3.6 and 3.9), four programs of 4 warps an
SM.

Split-K is deterministic and takes no second launch: with SPLIT_K > 1 each slice writes a float32 partial
[SPLIT_K, M, N], then counts itself in on its column tile's counter; the slice that arrives last adds the
partials in slice order, stores the output and resets the counter to zero for the next call (a separate sum
kernel cost ~3 µs a linear, 11% of a batch-1 8B decode step on an H100). The counters are one int32 per
column tile, shared by every GEMV on the device: calls must not overlap on two streams (the engine runs its
forward on one), and `reserve_split_counters` allocates them before CUDA graphs are captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.launch_config import split_k
from pagedserve.kernels.pdl import prologue

TILE_ROWS = 128  # inputs per tile of the layout (models/int4_repack.TILE_ROWS)


@triton.jit
def _group_params(qzeros_ptr, scales_ptr, group, stride_qz, stride_s, offs_n, mask_n, zero_offset):
    """Scale and zero point (float32, [BLOCK_N]) of one group."""
    scale = tl.load(scales_ptr + group * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    zeros = tl.load(qzeros_ptr + group * stride_qz + offs_n // 8, mask=mask_n, other=0)
    zero = (((zeros >> ((offs_n % 8) * 4)) & 0xF) + zero_offset).to(tl.float32)
    return scale, zero


# The high code of a pair (_biased_pair) as a float32 carries the low half's bits below its mantissa step:
# 0x4300 / 2^16 exactly, plus the low code / 2^16, whose mean (7.5 / 2^16) leaves with the bias too.
LOW_HALF_BIAS = tl.constexpr(0x4300 / 65536 + 7.5 / 65536)
# 0x43004300, 128.0 in both bf16 halves, passed as an argument: a register to ptxas, which then fuses the and-or
# into one LOP3 (a constant in its place took two, each at half the FMA rate: bench/gemv_sass.py).
PAIR_MAGIC = 0x43004300


@triton.jit
def _biased_pair(packed, s: tl.constexpr, pair_magic):
    """Nibbles s and s + 4 of each packed int32 as float32 bias + q by bits alone: one and-or puts each code in
    the low mantissa bits of a bf16 128.0 in its half (0x4300 | q); the low half shifted up is exactly 128 + q,
    the high half read in place is 128 + q + LOW_HALF_BIAS + (low code - 7.5) / 2^16, off by at most 1.2e-4 of
    a code step (the rounding of the 2048 + q products this replaced was ~1e-4). Two codes an and-or and an
    integer multiply for the low one, where one code took an and-or and half a shift: the integer pipe, which
    issues at half the FMA rate, bounded the loop (bench/gemv_sass.py)."""
    pair = ((packed >> (4 * s)) & 0x000F000F) | pair_magic
    low = (pair * 65536).to(tl.float32, bitcast=True)
    high = pair.to(tl.float32, bitcast=True)
    return low, high


@triton.jit
def _load_codes(qweight_ptr, rows, stride_qw, offs_n, mask):
    """Packed rows `rows` of the tiled weight at columns offs_n: [ROWS, BLOCK_N] int32, 0 where masked off."""
    return tl.load(qweight_ptr + rows[:, None].to(tl.int64) * stride_qw + offs_n[None, :], mask=mask, other=0)


@triton.jit
def _add_codes(
    packed,  # [ROWS, BLOCK_N]: packed rows of one tile, nibble i of row j = input kt + 16 i + first_row + j
    x_row_ptr,  # the activation row, at input kt + first_row
    kt,
    part,  # SLICE_GROUPS: the scaled sum so far [BLOCK_N]
    acc2,  # otherwise: sum of x * (bias + q) [ROWS, BLOCK_N], scaled per tile
    x_low_sum,  # and the sums of x of the pairs' low / high codes [ROWS]
    x_high_sum,
    qzeros_ptr,
    scales_ptr,
    group_size,
    zero_offset,
    pair_magic,
    stride_qz,
    stride_s,
    offs_n,
    mask_n,
    offs_j,
    SLICE_GROUPS: tl.constexpr,
):
    """Adds the products of `packed`'s codes with their activations (the module docstring's identity). Without
    SLICE_GROUPS the activations of the pairs' low and high codes are summed apart (_scaled_tile applies their
    biases)."""
    for s in tl.static_range(4):
        low, high = _biased_pair(packed, s, pair_magic)  # nibbles s and s + 4
        x_low = tl.load(x_row_ptr + 16 * s + offs_j).to(tl.float32)
        x_high = tl.load(x_row_ptr + 16 * (s + 4) + offs_j).to(tl.float32)
        if SLICE_GROUPS:
            for i in tl.static_range(2):
                q = low if i == 0 else high
                x = x_low if i == 0 else x_high
                scale, zero = _group_params(
                    qzeros_ptr,
                    scales_ptr,
                    (kt + 16 * (s + 4 * i)) // group_size,
                    stride_qz,
                    stride_s,
                    offs_n,
                    mask_n,
                    zero_offset,
                )
                dot = tl.sum(x[:, None] * q, axis=0)
                bias = 128.0 if i == 0 else 128.0 + LOW_HALF_BIAS
                part += scale * (dot - (zero + bias) * tl.sum(x, axis=0))
        else:
            acc2 += x_low[:, None] * low  # two FMAs (one sum of both products is a multiply and two adds)
            acc2 += x_high[:, None] * high
            x_low_sum += x_low
            x_high_sum += x_high
    return part, acc2, x_low_sum, x_high_sum


@triton.jit
def _scaled_tile(
    acc2,
    x_low_sum,
    x_high_sum,
    kt,
    qzeros_ptr,
    scales_ptr,
    group_size,
    zero_offset,
    stride_qz,
    stride_s,
    offs_n,
    mask_n,
):
    """A tile's (or a step's) sums of `_add_codes`, scaled by its group (groups of whole tiles)."""
    scale, zero = _group_params(
        qzeros_ptr, scales_ptr, kt // group_size, stride_qz, stride_s, offs_n, mask_n, zero_offset
    )
    low, high = tl.sum(x_low_sum, axis=0), tl.sum(x_high_sum, axis=0)
    biases = 128.0 * low + (128.0 + LOW_HALF_BIAS) * high
    return scale * (tl.sum(acc2, axis=0) - biases - zero * (low + high))


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K] fp16 / bf16 / fp32
    qweight_ptr,  # [K/8, N] int32, tiled
    qzeros_ptr,  # [K/G, N/8] int32, nibble j = column 8c + j (stored z - zero_offset)
    scales_ptr,  # [K/G, N]
    out_ptr,  # [M, N]
    partial_ptr,  # [SPLIT_K, M, N] fp32 (SPLIT_K > 1)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero between calls (SPLIT_K > 1)
    M,
    N,
    K,
    group_size,
    zero_offset,
    pair_magic,  # PAIR_MAGIC
    k_per_split,  # a multiple of 128
    stride_xm,
    stride_qw,
    stride_qz,
    stride_s,
    stride_om,
    stride_osplit,
    BLOCK_M: tl.constexpr,  # next power of two >= M (each row unpacks the tile again: meant for M = 1)
    BLOCK_N: tl.constexpr,
    SLICE_GROUPS: tl.constexpr,  # groups not whole tiles (32, 64, 192, ...): a scale per slice of 16 inputs
    SPLIT_K: tl.constexpr,
    ROWS: tl.constexpr,  # packed rows of a tile loaded and unpacked at a time (16 or 8): fewer live registers
    PREFETCH: tl.constexpr,  # one row: each ROWS-row load is issued before the math of the one before
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, ROWS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PREFETCH:
        acc += _prefetched_row(
            x_ptr,
            qweight_ptr,
            qzeros_ptr,
            scales_ptr,
            k_start,
            k_end,
            group_size,
            zero_offset,
            pair_magic,
            stride_qw,
            stride_qz,
            stride_s,
            offs_n,
            mask_n,
            offs_j,
            BLOCK_N,
            SLICE_GROUPS,
            ROWS,
            USE_PDL,
        )[None, :]
    else:
        prologue(USE_PDL)
        for kt in range(k_start, k_end, 128):
            for m in tl.static_range(BLOCK_M):
                row = tl.minimum(m, M - 1)  # rows past M (BLOCK_M is a power of two) repeat the last; never stored
                part = tl.zeros((BLOCK_N,), dtype=tl.float32)
                acc2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
                x_low_sum = tl.zeros((ROWS,), dtype=tl.float32)
                x_high_sum = tl.zeros((ROWS,), dtype=tl.float32)  # sums of x of the pairs' low / high codes
                for h in tl.static_range(16 // ROWS):  # the tile's 16 packed rows, ROWS at a time
                    packed = _load_codes(qweight_ptr, kt // 8 + h * ROWS + offs_j, stride_qw, offs_n, mask_n[None, :])
                    part, acc2, x_low_sum, x_high_sum = _add_codes(
                        packed,
                        x_ptr + row * stride_xm + kt + h * ROWS,
                        kt,
                        part,
                        acc2,
                        x_low_sum,
                        x_high_sum,
                        qzeros_ptr,
                        scales_ptr,
                        group_size,
                        zero_offset,
                        pair_magic,
                        stride_qz,
                        stride_s,
                        offs_n,
                        mask_n,
                        offs_j,
                        SLICE_GROUPS,
                    )
                if not SLICE_GROUPS:
                    part = _scaled_tile(
                        acc2,
                        x_low_sum,
                        x_high_sum,
                        kt,
                        qzeros_ptr,
                        scales_ptr,
                        group_size,
                        zero_offset,
                        stride_qz,
                        stride_s,
                        offs_n,
                        mask_n,
                    )
                if BLOCK_M == 1:
                    acc += part[None, :]
                else:
                    acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
    _store_split_k(acc, out_ptr, partial_ptr, counter_ptr, out_offs, mask, pid_n, pid_k, stride_osplit, SPLIT_K)


@triton.jit
def _prefetched_row(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    k_start,
    k_end,
    group_size,
    zero_offset,
    pair_magic,
    stride_qw,
    stride_qz,
    stride_s,
    offs_n,
    mask_n,
    offs_j,
    BLOCK_N: tl.constexpr,
    SLICE_GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Row 0's [BLOCK_N] sum over inputs k_start..k_end, walked in steps of ROWS packed rows (8 * ROWS inputs
    over the tile's nibbles) whose load is issued one step early: the next weights are in flight during this
    step's unpacking and FMAs (registers hold two steps' codes). The first load goes before the PDL wait."""
    halves: tl.constexpr = 16 // ROWS  # steps a tile of 128 inputs
    step = (k_start // 128) * halves
    step_end = tl.cdiv(k_end, 128) * halves
    rows = step * ROWS + offs_j  # an empty slice (split-K past K) loads nothing
    in_range = rows < tl.where(step < step_end, (step + 1) * ROWS, 0)
    following = _load_codes(qweight_ptr, rows, stride_qw, offs_n, in_range[:, None] & mask_n[None, :])
    prologue(USE_PDL)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    while step < step_end:
        packed = following
        rows = (step + 1) * ROWS + offs_j  # past the end: masked off (no traffic)
        in_range = rows < tl.where(step + 1 < step_end, (step + 2) * ROWS, 0)
        following = _load_codes(qweight_ptr, rows, stride_qw, offs_n, in_range[:, None] & mask_n[None, :])
        kt = (step // halves) * 128
        acc2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        x_low_sum = tl.zeros((ROWS,), dtype=tl.float32)
        x_high_sum = tl.zeros((ROWS,), dtype=tl.float32)
        total, acc2, x_low_sum, x_high_sum = _add_codes(
            packed,
            x_ptr + kt + (step % halves) * ROWS,
            kt,
            total,
            acc2,
            x_low_sum,
            x_high_sum,
            qzeros_ptr,
            scales_ptr,
            group_size,
            zero_offset,
            pair_magic,
            stride_qz,
            stride_s,
            offs_n,
            mask_n,
            offs_j,
            SLICE_GROUPS,
        )
        if not SLICE_GROUPS:
            total += _scaled_tile(
                acc2,
                x_low_sum,
                x_high_sum,
                kt,
                qzeros_ptr,
                scales_ptr,
                group_size,
                zero_offset,
                stride_qz,
                stride_s,
                offs_n,
                mask_n,
            )
        step += 1
    return total


@triton.jit
def _store_split_k(acc, out_ptr, partial_ptr, counter_ptr, out_offs, mask, tile, pid_k, stride_osplit, SPLIT_K):
    """Stores a program's output tile; with SPLIT_K > 1 its K slice's partial, and the tile's last slice to
    arrive adds them up in slice order (the scheme of the module docstring). The partials share out's offsets."""
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + pid_k * stride_osplit + out_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the program counts itself in
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")  # the slices before it (release/acquire)
        if arrived == SPLIT_K - 1:  # the last slice of this tile: the sum, in slice order (the same every run)
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(partial_ptr + s * stride_osplit + out_offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next call, or the next replay of a graph


GemvTiles = tuple[int, int, int]  # BLOCK_N, num_warps, SPLIT_K (0: auto)
# Int4Linear uses the GEMV up to this many rows, the tl.dot GEMM above. On an H100 at M = 1 the GEMV takes
# 0.63-0.80x the tiled GEMM's time (bench/results/w4a16_tiled_h100/); each further row unpacks the weight again
# (the old layout's GEMV was 7-33x slower than its GEMM at M = 4 and 8: bench/results/w4a16_gemv_h100/).
MAX_ROWS = 1
_TARGET_PROGRAMS = 528  # four per SM of an H100 / H200 (132 SMs)
# One-row calls load a step ahead (`_prefetched_row`). On an H200 (graph-timed, PDL, default tiles) the 8B linears
# took 8.6 / 8.2 / 28.9 / 18.4 µs against 11.1 / 7.7 / 28.7 / 20.8 without (qkv / o / gate_up / down;
# bench/results/pdl_h200x2_2026-11-28/); two codes an and-or, one LOP3 each, and the slices trimmed to those with
# inputs then took them to 7.6 / 7.6 / 23.3 / 16.7: 55.2 µs a layer against 64.1 (w4a16_pairs_h200_2026-11-29/).
PREFETCH = True
GEMV_ROWS = 8  # packed rows a load brings: 244 registers a thread for 16 (w4a16_tiled_h100/gemv_bits/rows/)


def default_gemv_tiles(m: int) -> GemvTiles:
    """512 columns over 4 warps: a thread holds GEMV_ROWS rows of 4 columns (one 16-byte load a row). The best of
    the H100 and H200 sweeps for the large 8B linears, within 2% on the small ones (w4a16_tiled_h100/)."""
    return 512, 4, 0


SPLIT_TILES = 8192  # column tiles: N up to 8192 * BLOCK_N
_split_counters: dict[torch.device, torch.Tensor] = {}


def reserve_split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K tile counters (zeros), allocated once: call it before capturing CUDA graphs."""
    counters = _split_counters.get(device)
    if counters is None:
        counters = _split_counters[device] = torch.zeros(SPLIT_TILES, dtype=torch.int32, device=device)
    return counters


def split_k_buffers(
    out: torch.Tensor, split: int, num_tiles: int, pitch: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `_store_split_k` needs for `split` K slices over `num_tiles` output tiles: the float32 partials
    [split, M, pitch] (rows `pitch` apart, as out's offsets say; default N) and the device's tile counters
    (`out` for both, never read, with one slice)."""
    if split == 1:
        return out, out
    assert num_tiles <= SPLIT_TILES, (out.shape, num_tiles)
    rows, n = out.shape
    partial = torch.empty((split, rows, n if pitch is None else pitch), dtype=torch.float32, device=out.device)
    return partial, reserve_split_counters(out.device)


def w4a16_gemv(
    x: torch.Tensor,  # [M, K], meant for M = 1 (any M works; each row unpacks the weight again)
    qweight: torch.Tensor,  # [K/8, N] int32, tiled (models/int4_repack.tile_rows)
    qzeros: torch.Tensor,  # [K/G, N/8] int32
    scales: torch.Tensor,  # [K/G, N]
    group_size: int,
    zero_offset: int = 0,
    tiles: GemvTiles | None = None,
    prefetch: bool | None = None,  # one row: issue each load a step early (default: PREFETCH)
) -> torch.Tensor:
    """x @ the tiled packed weight -> [M, N] in x's dtype (groups of consecutive rows, G % 16 == 0, K % 128 == 0)."""
    m, k = x.shape
    n = scales.shape[1]
    assert x.stride(1) == 1 and qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    assert qweight.shape == (k // 8, n) and k % group_size == 0, (qweight.shape, k, n, group_size)
    assert k % TILE_ROWS == 0 and group_size % 16 == 0, (k, group_size)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, warps, split = tiles or default_gemv_tiles(m)
    num_tiles = triton.cdiv(n, block_n)
    split = split or split_k(num_tiles, k, TILE_ROWS, _TARGET_PROGRAMS)
    k_per_split = triton.cdiv(triton.cdiv(k, split), TILE_ROWS) * TILE_ROWS
    split = triton.cdiv(k, k_per_split)  # no slice past K (down_proj of an 8B: 56 of 64 had inputs)
    partial, counters = split_k_buffers(out, split, num_tiles)
    _w4a16_gemv_kernel[(num_tiles, split)](
        x,
        qweight,
        qzeros,
        scales,
        out,
        partial,
        counters,
        m,
        n,
        k,
        group_size,
        zero_offset,
        PAIR_MAGIC,
        k_per_split,
        x.stride(0),
        qweight.stride(0),
        qzeros.stride(0),
        scales.stride(0),
        n,
        m * n,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        SLICE_GROUPS=group_size % TILE_ROWS != 0,
        SPLIT_K=split,
        ROWS=GEMV_ROWS,
        PREFETCH=(PREFETCH if prefetch is None else prefetch) and m == 1,
        num_warps=warps,
        **pdl.launch(x.device),
    )
    return out
