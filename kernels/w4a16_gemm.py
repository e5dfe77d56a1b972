"""W4A16 GEMM: y = x @ dequant(W) with W packed as 4-bit AWQ or GPTQ, dequantised tile by tile in registers.

    for each [BLOCK_M, BLOCK_N] output tile:
        for k in 0..K step BLOCK_K:
            w = (nibbles of qweight[k-tile, n-tile] - zero[g(k), n]) * scale[g(k), n]   (never written out)
            acc += x[m-tile, k-tile] @ w

The weight is read once per M-tile at 4 bits (plus a scale and zero per group): at decode sizes (M <=
64) the GEMM is bound by those bytes, a quarter of bf16's. Layouts (see services/engine/models/int4.py):
AWQ packs eight output columns per int32 in the order 0 2 4 6 1 3 5 7, GPTQ eight input rows
sequentially, with zeros stored minus one (v1) and an optional act-order g_idx; "tiled" is what Int4Linear
repacks them to (models/int4_repack.py), read by `_w4a16_tiled_kernel` a [16, N] slice per nibble (on CUDA
unpacked by a few lines of PTX, `_unpack_tile`), and above DEQUANTIZE_ABOVE_ROWS rows dequantised whole once
(`dequantize_tiled`) for cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.launch_config import split_k
from pagedserve.kernels.w4a16_gemv import _group_params, _store_split_k, split_k_buffers


@triton.jit
def _w4a16_kernel(
    x_ptr,
    qweight_ptr,
    qzeros_ptr,
    scales_ptr,
    g_idx_ptr,
    out_ptr,
    partial_ptr,  # [SPLIT_K, M, N] fp32 (SPLIT_K > 1)
    counter_ptr,  # [>= M tiles x N tiles] int32, zero between calls (SPLIT_K > 1)
    M,
    N,
    K,
    group_size,
    zero_offset,
    k_per_split,
    stride_xm,
    stride_qw,
    stride_qz,
    stride_s,
    stride_om,
    stride_osplit,
    IS_AWQ: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_pack = pid_n * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # packed columns (AWQ qweight, zeros)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_pack = offs_pack < N // 8
    # Column j of each group of eight sits in nibble j (sequential) or, in AWQ's order, in nibble 0 4 1 5 2 6 3 7.
    j = tl.arange(0, 8)
    seq_shift = j * 4
    awq_shift = ((j % 2) * 4 + j // 2) * 4
    col_shift = awq_shift if IS_AWQ else seq_shift
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        if IS_AWQ:  # qweight [K, N/8]: one int32 load gives eight neighbouring columns
            packed = tl.load(
                qweight_ptr + offs_k[:, None] * stride_qw + offs_pack[None, :],
                mask=mask_k[:, None] & mask_pack[None, :],
                other=0,
            )
            q = tl.reshape((packed[:, :, None] >> col_shift[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
        else:  # qweight [K/8, N]: one int32 load gives eight neighbouring rows
            offs_kp = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(
                qweight_ptr + offs_kp[:, None] * stride_qw + offs_n[None, :],
                mask=(offs_kp < K // 8)[:, None] & mask_n[None, :],
                other=0,
            )
            q = tl.reshape((packed[:, None, :] >> seq_shift[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        if HAS_G_IDX:  # act order: any row in any group, so a scale and zero per element
            groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
            zeros = tl.load(
                qzeros_ptr + groups[:, None] * stride_qz + (offs_n // 8)[None, :],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0,
            )
            zeros = ((zeros >> ((offs_n % 8) * 4)[None, :]) & 0xF) + zero_offset
            scales = tl.load(
                scales_ptr + groups[:, None] * stride_s + offs_n[None, :],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            ).to(tl.float32)
            w = (q - zeros).to(tl.float32) * scales
        else:  # BLOCK_K divides the group size: one scale and zero per column for the whole tile
            group = k0 // group_size
            packed_zeros = tl.load(qzeros_ptr + group * stride_qz + offs_pack, mask=mask_pack, other=0)
            zeros = tl.reshape((packed_zeros[:, None] >> col_shift[None, :]) & 0xF, (BLOCK_N,)) + zero_offset
            scales = tl.load(scales_ptr + group * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * scales[None, :] - (zeros.to(tl.float32) * scales)[None, :]
        acc += tl.dot(x, w.to(x.dtype))
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    tile = pid_m * tl.num_programs(1) + pid_n
    _store_split_k(acc, out_ptr, partial_ptr, counter_ptr, out_offs, mask, tile, pid_k, stride_osplit, SPLIT_K)


# Marlin-style unpacking (CUDA only): a nibble ORed into the exponent pattern of 128 (bf16) or 1024 (fp16) is
# that number plus the nibble, exactly; subtracting (magic + zero) is exact too, and one multiply by the scale
# rounds once, as the float32 path does. Two weights per instruction (bf16x2 / f16x2) and no int-to-float
# conversion: ~2 instructions a weight instead of ~6.5 (shift, sign-extend, I2F, FMA, half a pack, address).
# $8, $9: two packed int32 (nibble i -> slice i); $10: -(magic + zero) x2; $11: scale x2; $0..$7: slices 0..7.
_UNPACK_ASM = """
{
.reg .b32 lo, hi, t, one, nz;
mov.b32 one, ONE;
mov.b32 nz, NEG_ZERO;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
lop3.b32 $0, lo, 0x000F000F, MAGIC, 0xEA;
shr.u32 t, lo, 4;
lop3.b32 $1, t, 0x000F000F, MAGIC, 0xEA;
shr.u32 t, lo, 8;
lop3.b32 $2, t, 0x000F000F, MAGIC, 0xEA;
shr.u32 t, lo, 12;
lop3.b32 $3, t, 0x000F000F, MAGIC, 0xEA;
lop3.b32 $4, hi, 0x000F000F, MAGIC, 0xEA;
shr.u32 t, hi, 4;
lop3.b32 $5, t, 0x000F000F, MAGIC, 0xEA;
shr.u32 t, hi, 8;
lop3.b32 $6, t, 0x000F000F, MAGIC, 0xEA;
shr.u32 t, hi, 12;
lop3.b32 $7, t, 0x000F000F, MAGIC, 0xEA;
fma.rn.TYPE $0, $0, one, $10;
fma.rn.TYPE $1, $1, one, $10;
fma.rn.TYPE $2, $2, one, $10;
fma.rn.TYPE $3, $3, one, $10;
fma.rn.TYPE $4, $4, one, $10;
fma.rn.TYPE $5, $5, one, $10;
fma.rn.TYPE $6, $6, one, $10;
fma.rn.TYPE $7, $7, one, $10;
fma.rn.TYPE $0, $0, $11, nz;
fma.rn.TYPE $1, $1, $11, nz;
fma.rn.TYPE $2, $2, $11, nz;
fma.rn.TYPE $3, $3, $11, nz;
fma.rn.TYPE $4, $4, $11, nz;
fma.rn.TYPE $5, $5, $11, nz;
fma.rn.TYPE $6, $6, $11, nz;
fma.rn.TYPE $7, $7, $11, nz;
}
"""
_UNPACK_BF16 = tl.constexpr(
    _UNPACK_ASM.replace("MAGIC", "0x43004300")
    .replace("TYPE", "bf16x2")
    .replace("ONE", "0x3F803F80")
    .replace("NEG_ZERO", "0x80008000")
)
_UNPACK_FP16 = tl.constexpr(
    _UNPACK_ASM.replace("MAGIC", "0x64006400")
    .replace("TYPE", "f16x2")
    .replace("ONE", "0x3C003C00")
    .replace("NEG_ZERO", "0x80008000")
)


@triton.jit
def _unpack_tile(packed, scale, zero, IS_FP16: tl.constexpr):
    """The 8 weight slices of a tile ([16, N] or [N, 16] packed int32 -> 8 tensors of x's 16-bit type); `scale`
    and `zero` (float32) broadcast to packed's shape."""
    dtype: tl.constexpr = tl.float16 if IS_FP16 else tl.bfloat16
    magic: tl.constexpr = 1024.0 if IS_FP16 else 128.0
    asm: tl.constexpr = _UNPACK_FP16 if IS_FP16 else _UNPACK_BF16
    scale = tl.broadcast_to(scale.to(dtype), packed.shape)
    neg_magic_zero = tl.broadcast_to(-(zero + magic).to(dtype), packed.shape)
    return tl.inline_asm_elementwise(
        asm,
        "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
        [packed, neg_magic_zero, scale],
        dtype=(scale.dtype,) * 8,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _float_slices(packed, scale, zero):
    """The 8 weight slices of a tile in float32 arithmetic (any device; the interpreter too): w = q s - z s."""
    zero_scaled = -zero * scale
    return (
        (packed & 0xF).to(tl.float32) * scale + zero_scaled,
        ((packed >> 4) & 0xF).to(tl.float32) * scale + zero_scaled,
        ((packed >> 8) & 0xF).to(tl.float32) * scale + zero_scaled,
        ((packed >> 12) & 0xF).to(tl.float32) * scale + zero_scaled,
        ((packed >> 16) & 0xF).to(tl.float32) * scale + zero_scaled,
        ((packed >> 20) & 0xF).to(tl.float32) * scale + zero_scaled,
        ((packed >> 24) & 0xF).to(tl.float32) * scale + zero_scaled,
        ((packed >> 28) & 0xF).to(tl.float32) * scale + zero_scaled,
    )


@triton.jit
def _joined(slices):
    """The 8 [N, 16] slices as one [N, 128] operand, slice i in columns 16i.. (the tile's inputs in order): in
    the MMA's operand layout each thread already holds, for step i of a depth-128 dot, slice i's registers, so
    the joins, the permute and the reshape only rename them."""
    p0 = tl.join(slices[0], slices[4])
    p1 = tl.join(slices[1], slices[5])
    p2 = tl.join(slices[2], slices[6])
    p3 = tl.join(slices[3], slices[7])
    n: tl.constexpr = slices[0].shape[0]
    stacked = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [n, 16, i & 4, i & 2, i & 1]
    return tl.reshape(tl.permute(stacked, (0, 2, 3, 4, 1)), (n, 128))


@triton.jit
def _w4a16_tiled_kernel(
    x_ptr,
    qweight_ptr,  # [K/8, N] int32, tiled: packed row 16t + j, nibble i = input 128t + 16i + j
    qzeros_ptr,
    scales_ptr,
    out_ptr,
    partial_ptr,  # [SPLIT_K, M, N] fp32 (SPLIT_K > 1)
    counter_ptr,  # [>= M tiles x N tiles] int32, zero between calls (SPLIT_K > 1)
    M,
    N,
    K,
    group_size,
    zero_offset,
    k_per_split,  # a multiple of 128
    stride_xm,
    stride_qw,
    stride_qz,
    stride_s,
    stride_om,
    stride_osplit,
    SLICE_GROUPS: tl.constexpr,  # groups not whole tiles (32, 64, 192, ...): a scale per slice of 16 inputs
    UNPACK_ASM: tl.constexpr,  # CUDA, 16-bit x, whole-tile groups: _unpack_tile (else float32 arithmetic)
    SWAP: tl.constexpr,  # out^T = W^T x^T: the weight is the MMA's wide side, few rows its narrow one
    JOIN: tl.constexpr,  # SWAP, whole-tile groups: the tile's slices joined into one dot of depth 128
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The tiled layout's GEMM: per tile of 128 inputs one [16, BLOCK_N] load; slice i of it is rows 16i.. of the
    tile, dequantised as it is and fed to an MMA of depth 16 (or, JOIN, all 8 to one MMA of depth 128: its steps
    issue back to back, where separate dots on register operands each wait for the last), with no reshape of the
    nibbles."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_j = tl.arange(0, 16)
    r = tl.arange(0, 128)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if UNPACK_ASM and not JOIN:
        # These tiles load each tile's scale and zero a tile ahead: the compiler's pipelining left those loads in
        # the tile that uses them, where each waited out its latency (Nsight Compute, 2026-11-29).
        next_scale, next_zero = _group_params(
            qzeros_ptr, scales_ptr, k_start // group_size, stride_qz, stride_s, offs_n, mask_n, zero_offset
        )
    for kt in range(k_start, k_end, 128):
        rows = kt // 8 + offs_j
        if SWAP:  # [BLOCK_N, 16]
            packed = tl.load(qweight_ptr + rows[None, :] * stride_qw + offs_n[:, None], mask=mask_n[:, None], other=0)
        else:  # [16, BLOCK_N]
            packed = tl.load(qweight_ptr + rows[:, None] * stride_qw + offs_n[None, :], mask=mask_n[None, :], other=0)
        if JOIN:  # SWAP and whole-tile groups
            scale, zero = _group_params(
                qzeros_ptr, scales_ptr, kt // group_size, stride_qz, stride_s, offs_n, mask_n, zero_offset
            )
            if UNPACK_ASM:
                slices = _unpack_tile(packed, scale[:, None], zero[:, None], x_ptr.dtype.element_ty == tl.float16)
            else:
                slices = _float_slices(packed, scale[:, None], zero[:, None])
            w = _joined(slices).to(x_ptr.dtype.element_ty)
            x = tl.load(x_ptr + offs_m[None, :] * stride_xm + (kt + r)[:, None], mask=mask_m[None, :], other=0.0)
            acc += tl.dot(w, x)
        elif UNPACK_ASM:
            scale, zero = next_scale, next_zero
            ahead = tl.minimum(kt + 128, k_end - 1) // group_size  # (past the end: this tile's group again)
            next_scale, next_zero = _group_params(
                qzeros_ptr, scales_ptr, ahead, stride_qz, stride_s, offs_n, mask_n, zero_offset
            )
            if SWAP:  # per column of the weight: its rows of packed (SWAP) or its columns
                scale, zero = scale[:, None], zero[:, None]
            else:
                scale, zero = scale[None, :], zero[None, :]
            slices = _unpack_tile(packed, scale, zero, x_ptr.dtype.element_ty == tl.float16)
            for i in tl.static_range(8):
                offs_k = kt + 16 * i + offs_j
                if SWAP:
                    x = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=mask_m[None, :], other=0.0)
                    acc += tl.dot(slices[i], x)
                else:
                    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                    acc += tl.dot(x, slices[i])
        else:
            for i in tl.static_range(8):
                if SLICE_GROUPS or i == 0:  # w = q * s - z * s, per column of the group
                    group = (kt + 16 * i) // group_size
                    scale, zero = _group_params(
                        qzeros_ptr, scales_ptr, group, stride_qz, stride_s, offs_n, mask_n, zero_offset
                    )
                    zero_scaled = -zero * scale
                q = ((packed >> (4 * i)) & 0xF).to(tl.float32)
                offs_k = kt + 16 * i + offs_j
                if SWAP:
                    w = (q * scale[:, None] + zero_scaled[:, None]).to(x_ptr.dtype.element_ty)
                    x = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=mask_m[None, :], other=0.0)
                    acc += tl.dot(w, x)
                else:
                    w = (q * scale[None, :] + zero_scaled[None, :]).to(x_ptr.dtype.element_ty)
                    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
                    acc += tl.dot(x, w)
    if SWAP:
        out_offs = offs_m[None, :] * stride_om + offs_n[:, None]
        mask = mask_m[None, :] & mask_n[:, None]
    else:
        out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
    tile = pid_m * tl.num_programs(1) + pid_n
    _store_split_k(acc, out_ptr, partial_ptr, counter_ptr, out_offs, mask, tile, pid_k, stride_osplit, SPLIT_K)


@triton.jit
def _dequantize_tiled_kernel(
    qweight_ptr,  # [K/8, N] int32, tiled
    qzeros_ptr,
    scales_ptr,
    out_ptr,  # [K, N]
    N,
    group_size,
    zero_offset,
    stride_qw,
    stride_qz,
    stride_s,
    stride_o,
    BLOCK_N: tl.constexpr,
):
    """One tile of 128 inputs x BLOCK_N columns: its [16, BLOCK_N] packed rows to 128 rows of weights."""
    tile = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_j = tl.arange(0, 16)
    packed = tl.load(qweight_ptr + (tile * 16 + offs_j)[:, None] * stride_qw + offs_n[None, :], mask=mask_n[None, :])
    for i in tl.static_range(8):
        rows = tile * 128 + 16 * i + offs_j
        group = (tile * 128 + 16 * i) // group_size
        scale, zero = _group_params(qzeros_ptr, scales_ptr, group, stride_qz, stride_s, offs_n, mask_n, zero_offset)
        w = (((packed >> (4 * i)) & 0xF).to(tl.float32) - zero[None, :]) * scale[None, :]
        out = out_ptr + rows[:, None].to(tl.int64) * stride_o + offs_n[None, :]
        tl.store(out, w.to(out_ptr.dtype.element_ty), mask=mask_n[None, :])


def dequantize_tiled(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zero_offset: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The tiled layout's weight W [K, N] in `dtype` (for prefill-sized GEMMs: cuBLAS on it beats dequantising
    in every M tile once M is in the hundreds)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    out = torch.empty((k, n), dtype=dtype, device=qweight.device)
    block_n = 128
    _dequantize_tiled_kernel[(k // 128, triton.cdiv(n, block_n))](
        qweight,
        qzeros,
        scales,
        out,
        n,
        group_size,
        zero_offset,
        qweight.stride(0),
        qzeros.stride(0),
        scales.stride(0),
        out.stride(0),
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out


# BLOCK_M, BLOCK_N, BLOCK_K (tiled: SWAP, 0 / 1 / 2 = swapped with the slices joined), warps, stages, SPLIT_K (0: auto)
Tiles = tuple[int, int, int, int, int, int]
_TARGET_PROGRAMS = 264  # two per SM of an H100: enough loads in flight to stream the weight
_FULL_GRID = 132  # one program per SM of an H100
# Above this many rows the tiled layout is dequantised once to x's dtype and cuBLAS multiplies: at 256 rows on
# an H100 the fused GEMM and dequantise + cuBLAS cost about the same on the 8B linears, and the fused one
# dequantises the weight again in every 128-row tile (a 32K-token prefill: 64 times).
DEQUANTIZE_ABOVE_ROWS = 256
UNPACK_WITH_ASM = True  # the tiled GEMM's Marlin-style unpacking on CUDA (benchmarks turn it off to compare)
# default_tiled_tiles' SWAP for 128-column tiles. 2 (a tile's slices joined into one dot of depth 128) compiles
# for sm_90 to eight wgmma steps in flight at once, where separate dots (1) wait for each other; joined in the
# inputs' order since 2026-11-29 (x loaded contiguous, no shuffle through shared memory). At 128 columns the H200
# sweep of that day found it no faster, and the 8B decode at batch 64 slower with it (5,433 against 6,077 out
# tok/s); at 64 columns it is the best tile (bench/results/w4a16_joined_h200_2026-11-29/).
SEPARATE, JOINED = 1, 2  # SWAP: the slices as separate dots of depth 16, or joined into one of depth 128
WIDE_TILE_SWAP = SEPARATE
# At <= 16 rows, 64-column tiles when three times the 128-column tiles would not fill the GPU (the 8B o and down:
# 32 tiles; qkv's 48 keep 128 columns): the H200 sweep's best on each side of that line.
FEW_COLUMN_TILES_FACTOR = 3


def default_tiles(m: int) -> Tiles:
    """Small M tiles for decode, split over K when N alone gives too few programs; wider tiles for prefill."""
    if m <= 16:  # the H100 sweep's best for most 8B linears (bench/results/w4a16_h100/)
        return 16, 128, 128, 4, 4, 0
    if m <= 64:
        return 64, 64, 64, 4, 4, 0
    return 128, 128, 64, 8, 3, 1


def default_tiled_tiles(m: int, n: int) -> Tiles:
    """(BLOCK_M, BLOCK_N, SWAP, warps, stages, SPLIT_K) for the tiled layout at <= 64 rows: few rows go on the
    MMA's narrow side (SWAP). Where the 128-column tiles are many (at 64 rows: they alone fill the GPU, like the 8B
    gate_up's 224; at 16: FEW_COLUMN_TILES_FACTOR times them would), 128 columns a program, separate slices; else
    64 columns with the slices joined (more programs, each with eight MMA steps in flight; groups that are not
    whole tiles take separate slices anyway), split over K as the grid needs. The H200 sweep's best, or within 5%
    of it, on the 8B linears at 16 and 64 rows but o at 64 (20.9 against 18.4 µs;
    bench/results/w4a16_joined_h200_2026-11-29/)."""
    if m > 64:
        return 128, 128, 0, 8, 3, 1
    column_tiles = triton.cdiv(n, 128)
    if m <= 16:
        if FEW_COLUMN_TILES_FACTOR * column_tiles < _FULL_GRID:
            return 16, 64, JOINED, 4, 3, 0
        return 16, 128, WIDE_TILE_SWAP, 4, 3, 0
    if column_tiles >= _FULL_GRID:
        return 64, 128, WIDE_TILE_SWAP, 4, 3, 1
    return 32 if m <= 32 else 64, 64, JOINED, 4, 3, 0


def k_slices(k: int, split: int, k_tile: int) -> tuple[int, int]:
    """(slices, inputs a slice) for `split` slices of K in whole K tiles, fewer where a slice would start past K
    (the tiled kernel reads a slice's first scales before its loop)."""
    k_per_split = triton.cdiv(triton.cdiv(k, split), k_tile) * k_tile
    return triton.cdiv(k, k_per_split), k_per_split


def _launch_split_k(
    kernel: triton.JITFunction,
    x: torch.Tensor,
    weights: tuple[torch.Tensor, ...],  # qweight, qzeros, scales (and g_idx for the checkpoint layouts)
    out: torch.Tensor,
    group_size: int,
    zero_offset: int,
    block_m: int,
    block_n: int,
    k_tile: int,  # slices hold whole K tiles
    min_slice: int,
    split: int,  # 0: enough K slices for _TARGET_PROGRAMS programs
    **meta: int | bool,
) -> torch.Tensor:
    """Launches a W4A16 GEMM over (M tiles, N tiles, K slices). With more than one slice each writes a float32
    partial and the last of a tile's slices sums them into `out` (w4a16_gemv's deterministic split-K: no
    zero-filled buffer, no copy after)."""
    (m, k), n = x.shape, out.shape[1]
    grid_m, grid_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    split, k_per_split = k_slices(k, split or split_k(grid_m * grid_n, k, min_slice, _TARGET_PROGRAMS), k_tile)
    partial, counters = split_k_buffers(out, split, grid_m * grid_n)
    qweight, qzeros, scales = weights[:3]
    kernel[(grid_m, grid_n, split)](
        x,
        *weights,
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
        out.stride(0),
        m * n,
        SPLIT_K=split,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **meta,
    )
    return out


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    fmt: str,  # "awq", "gptq" (checkpoint layouts) or "tiled" (what Int4Linear repacks to)
    zero_offset: int = 0,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ the packed weight -> [M, N] in x's dtype. `tiles`: override (benchmarks)."""
    m, k = x.shape
    n = scales.shape[1]
    assert x.stride(1) == 1 and qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if fmt == "tiled":
        assert g_idx is None, "the tiled layout has its groups in order"
        if tiles is None and m > DEQUANTIZE_ABOVE_ROWS:
            weight = dequantize_tiled(qweight, qzeros, scales, group_size, zero_offset, x.dtype)
            return torch.matmul(x, weight, out=out)
        block_m, block_n, swap, warps, stages, split = tiles or default_tiled_tiles(m, n)
        assert k % 128 == 0 and group_size % 16 == 0, (k, group_size)
        return _launch_split_k(
            _w4a16_tiled_kernel,
            x,
            (qweight, qzeros, scales),
            out,
            group_size,
            zero_offset,
            block_m,
            block_n,
            k_tile=128,
            min_slice=256,  # slices of >= 2 tiles
            split=split,
            SLICE_GROUPS=group_size % 128 != 0,
            UNPACK_ASM=UNPACK_WITH_ASM
            and x.is_cuda
            and x.dtype in (torch.float16, torch.bfloat16)
            and group_size % 128 == 0,
            SWAP=bool(swap),
            JOIN=swap == 2 and group_size % 128 == 0,
            num_warps=warps,
            num_stages=stages,
        )
    block_m, block_n, block_k, warps, stages, split = tiles or default_tiles(m)
    block_k = min(block_k, group_size)  # a K tile never straddles two groups (group sizes are powers of two)
    assert group_size % block_k == 0 and block_n % 8 == 0, (group_size, block_k, block_n)
    return _launch_split_k(
        _w4a16_kernel,
        x,
        (qweight, qzeros, scales, g_idx if g_idx is not None else qzeros),
        out,
        group_size,
        zero_offset,
        block_m,
        block_n,
        k_tile=block_k,
        min_slice=4 * block_k,  # slices of >= 4 K tiles
        split=split,
        IS_AWQ=fmt == "awq",
        HAS_G_IDX=g_idx is not None,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
