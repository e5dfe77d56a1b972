"""W4A16 GEMV for decode (M <= 8 rows): y = x @ dequant(W), W packed K-major (GPTQ's layout), no tl.dot.

tl.dot's smallest tile has 16 rows, so at M = 1 the GEMM (kernels/w4a16_gemm.py) pays for 16x the products
and its dequantisation bounds it (bench/results/w4a16_h100/summary.md). Here each program owns BLOCK_N
output columns and a slice of K; every weight is unpacked once and multiplied by each of the M rows on the
CUDA cores, with the zero point and scale folded out of the inner loop (one group per K tile):

    sum_{k in g} x[m,k] s[g,n] (q[k,n] - z[g,n])  =  s[g,n] (sum_{k in g} x[m,k] q[k,n] - z[g,n] sum_{k in g} x[m,k])

    qweight [K/8, N] int32: nibble i of row r is input 8r + i, so a row of packed ints is contiguous along N
    program (n-tile, k-slice):  for each BLOCK_K tile of its slice:  q [BLOCK_K/8, 8, BLOCK_N] <- shifts of one
                                [BLOCK_K/8, BLOCK_N] load;  acc[m, :] += per-group folded partial sums

Split-K is deterministic and takes no second launch: with SPLIT_K > 1 each slice writes a float32 partial
[SPLIT_K, M, N], then counts itself in on its column tile's counter; the slice that arrives last adds the
partials in slice order, stores the output and resets the counter to zero for the next call (a separate sum
kernel cost ~3 µs a linear, 11% of a batch-1 8B decode step on an H100). The counters are one int32 per
column tile, shared by every GEMV on the device: calls must not overlap on two streams (the engine runs its
forward on one), and `reserve_split_counters` allocates them before CUDA graphs are captured.
Layouts other than plain GPTQ reach this kernel through a load-time repack (services/engine/models/int4.py):
AWQ's column packing is unpacked and packed along K, act order's rows are sorted by group (x is gathered).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.launch_config import split_k


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,  # [M, K] fp16 / bf16 / fp32
    qweight_ptr,  # [K/8, N] int32, nibble i of row r = input 8r + i
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
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_qw,
    stride_qz,
    stride_s,
    stride_om,
    stride_osplit,
    BLOCK_M: tl.constexpr,  # next power of two >= M
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides the group size: a tile lies in one group
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_K // 8)  # packed rows of a tile
    nibble = tl.arange(0, 8)
    zero_shift = (offs_n % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        rows = k0 // 8 + offs_r
        packed = tl.load(
            qweight_ptr + rows[:, None].to(tl.int64) * stride_qw + offs_n[None, :],
            mask=(rows < K // 8)[:, None] & mask_n[None, :],
            other=0,
        )  # [BLOCK_K/8, BLOCK_N]
        q = ((packed[:, None, :] >> (nibble * 4)[None, :, None]) & 0xF).to(tl.float32)  # [BLOCK_K/8, 8, BLOCK_N]
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zeros = tl.load(qzeros_ptr + group * stride_qz + offs_n // 8, mask=mask_n, other=0)
        zero = (((zeros >> zero_shift) & 0xF) + zero_offset).to(tl.float32)  # [BLOCK_N]
        offs_k = k0 + offs_r[:, None] * 8 + nibble[None, :]  # [BLOCK_K/8, 8], input 8r + i as q holds it
        for m in tl.static_range(BLOCK_M):  # each row reuses the unpacked q
            row = tl.minimum(m, M - 1)  # rows past M (BLOCK_M is a power of two) repeat the last; never stored
            x = tl.load(x_ptr + row * stride_xm + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            dot = tl.sum(tl.sum(x[:, :, None] * q, axis=1), axis=0)  # [BLOCK_N]: sum_k x[m, k] q[k, n]
            x_sum = tl.sum(tl.sum(x, axis=1), axis=0)
            part = (dot - x_sum * zero) * scale
            if BLOCK_M == 1:
                acc += part[None, :]
            else:
                acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_ptr + pid_k * stride_osplit + out_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the program counts itself in
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")  # the slices before it (release/acquire)
        if arrived == SPLIT_K - 1:  # the last slice of this tile: the sum, in slice order (the same every run)
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(partial_ptr + s * stride_osplit + out_offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next call, or the next replay of a graph


GemvTiles = tuple[int, int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K (0: auto)
# Int4Linear uses the GEMV up to this many rows, the tl.dot GEMM above. An H100 (bench/results/w4a16_gemv_h100/):
# at M = 1 the GEMV took 0.55-0.70x the GEMM's time; at M = 4 and 8 it was 7-33x slower (the per-row loop).
MAX_ROWS = 1
_TARGET_PROGRAMS = 528  # four per SM of an H100: enough loads in flight to stream the weight
_MIN_K_PER_SPLIT = 256


def default_gemv_tiles(m: int) -> GemvTiles:
    """A guess until an H100 sweep (bench/w4a16_gemm.py --gemv-sweep) says better: narrower tiles as rows grow."""
    if m <= 2:
        return 128, 128, 4, 3, 0
    return 64, 128, 4, 3, 0


_COUNTERS = 8192  # column tiles: N up to 8192 * BLOCK_N
_split_counters: dict[torch.device, torch.Tensor] = {}


def reserve_split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K tile counters (zeros), allocated once: call it before capturing CUDA graphs."""
    counters = _split_counters.get(device)
    if counters is None:
        counters = _split_counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counters


def w4a16_gemv(
    x: torch.Tensor,  # [M, K], M <= 8 (any M works; the products grow with it)
    qweight: torch.Tensor,  # [K/8, N] int32
    qzeros: torch.Tensor,  # [K/G, N/8] int32
    scales: torch.Tensor,  # [K/G, N]
    group_size: int,
    zero_offset: int = 0,
    tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """x @ the K-major packed weight -> [M, N] in x's dtype (groups of consecutive rows: no act order here)."""
    m, k = x.shape
    n = scales.shape[1]
    assert x.stride(1) == 1 and qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    assert qweight.shape == (k // 8, n) and k % group_size == 0, (qweight.shape, k, n, group_size)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_n, block_k, warps, stages, split = tiles or default_gemv_tiles(m)
    block_k = min(block_k, group_size)
    assert group_size % block_k == 0 and block_k % 8 == 0, (group_size, block_k)
    num_tiles = triton.cdiv(n, block_n)
    split = split or split_k(num_tiles, k, max(block_k, _MIN_K_PER_SPLIT), _TARGET_PROGRAMS)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    partial, counters = out, out  # unread with one slice
    if split > 1:
        assert num_tiles <= _COUNTERS, (n, block_n)
        partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = reserve_split_counters(x.device)
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
        k_per_split,
        x.stride(0),
        qweight.stride(0),
        qzeros.stride(0),
        scales.stride(0),
        n,
        m * n,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        num_warps=warps,
        num_stages=stages,
    )
    return out
