"""Dense GEMV for decode (a few rows): y = x @ W^T (+ bias), W [N, K] as nn.Linear stores it, no tl.dot.

At M = 1 a decode step is a chain of matrix-vector products that should run at the memory floor, but cuBLAS
picks 8-row tensor-core tiles, with a split-K reduce kernel after some: on an H200 it reads the weights of a
Llama-8B TP=2 rank's qkv / o / gate_up / down at 2.1 / 2.3 / 3.7 / 2.9 TB/s, where this kernel reaches
2.9 / 2.8 / 4.0 / 3.7 (bench/results/gemv_h200x2_2026-11-28/).

Each program owns BLOCK_N weight rows and walks a slice of K in BLOCK_K steps: coalesced 16-byte loads along
the rows, products on the CUDA cores into one [BLOCK_N, BLOCK_K] fp32 accumulator per activation row, one
reduction at the end. Many small programs (one weight row each by default) keep enough loads in flight per SM
to hide HBM latency without split-K; where the grid is still short, K is split and the last slice to arrive
adds the partials in slice order (`_store_split_k`, shared with the W4A16 GEMV: deterministic, no second
launch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels import pdl
from pagedserve.kernels.launch_config import split_k
from pagedserve.kernels.pdl import prologue
from pagedserve.kernels.silu_mul import silu_mul
from pagedserve.kernels.w4a16_gemv import _store_split_k, split_k_buffers

GemvConfig = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, SPLIT_K (0: auto)
MAX_ROWS = 4  # each extra row costs registers, not weight reads (already at 2 rows cuBLAS wins on most 8B linears)
_TARGET_PROGRAMS = 1056  # eight per SM of an H100 / H200: enough 16-byte loads in flight to cover HBM latency


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """One row x 1024 inputs over 4 warps (one 16-byte load a thread a step): of an 11-tile sweep at M = 1 on an
    H200, the least total time over the four linears of the Llama-8B shape at TP = 1 and 2 and within 0.5% of the
    best at TP = 4 and on SmolLM2 (bench/results/gemv_h200x2_2026-11-28/); split-K only where the grid has
    under `_TARGET_PROGRAMS`."""
    return 1, 1024, 4, 0


@triton.jit
def _load_x(x_ptr, ROW: tl.constexpr, M, ks, k_end, stride_xm, BLOCK_N: tl.constexpr):
    """Row ROW of the activations at inputs ks (< k_end), fp32, repeated over the tile's BLOCK_N rows. Loading
    it at the weight tile's shape puts it in the tile's layout, each thread reading the inputs it multiplies
    (from L1): a [BLOCK_K] load went through shared memory with two barriers every step."""
    ks = ks[None, :] + tl.zeros((BLOCK_N, 1), dtype=tl.int32)
    mask = ks < tl.where(M > ROW, k_end, 0)  # rows past M read nothing
    return tl.load(x_ptr + ROW * stride_xm + ks, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_w(w_rows, ks, k_end, EVEN_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight tile at inputs ks (< k_end), streamed past the caches once."""
    if EVEN_K:
        return tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + ks[None, :], mask=(ks < k_end)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _accumulate(
    w, x_ptr, ks, k_end, M, stride_xm, acc0, acc1, acc2, acc3, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Adds one weight tile's products with each activation row (rows past BLOCK_M untouched)."""
    w = w.to(tl.float32)
    acc0 += w * _load_x(x_ptr, 0, M, ks, k_end, stride_xm, BLOCK_N)
    if BLOCK_M > 1:
        acc1 += w * _load_x(x_ptr, 1, M, ks, k_end, stride_xm, BLOCK_N)
    if BLOCK_M > 2:
        acc2 += w * _load_x(x_ptr, 2, M, ks, k_end, stride_xm, BLOCK_N)
        acc3 += w * _load_x(x_ptr, 3, M, ks, k_end, stride_xm, BLOCK_N)
    return acc0, acc1, acc2, acc3


@triton.jit
def _accumulate_gated(w_gate, w_up, x_ptr, ks, k_end, M, stride_xm, acc_gate, acc_up, BLOCK_N: tl.constexpr):
    """One row: adds a gate tile's and the matching up tile's products (one activation load for both)."""
    x = _load_x(x_ptr, 0, M, ks, k_end, stride_xm, BLOCK_N)
    return acc_gate + w_gate.to(tl.float32) * x, acc_up + w_up.to(tl.float32) * x


@triton.jit
def _load_tiles(w_rows, up_rows, ks, k_end, EVEN_K: tl.constexpr, GATED: tl.constexpr):
    """This step's weight tile and, GATED, its up rows' tile (else the same tile again, unused)."""
    w = _load_w(w_rows, ks, k_end, EVEN_K)
    if GATED:
        return w, _load_w(up_rows, ks, k_end, EVEN_K)
    return w, w


@triton.jit
def _add_tiles(
    w,
    w_up,
    x_ptr,
    ks,
    k_end,
    M,
    stride_xm,
    acc0,
    acc1,
    acc2,
    acc3,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GATED: tl.constexpr,
):
    """`_accumulate`, or GATED `_accumulate_gated` into acc0 (gate) and acc1 (up)."""
    if GATED:
        acc0, acc1 = _accumulate_gated(w, w_up, x_ptr, ks, k_end, M, stride_xm, acc0, acc1, BLOCK_N)
    else:
        acc0, acc1, acc2, acc3 = _accumulate(
            w, x_ptr, ks, k_end, M, stride_xm, acc0, acc1, acc2, acc3, BLOCK_M, BLOCK_N
        )
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K], rows contiguous
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N], rows stride_om apart
    partial_ptr,  # [SPLIT_K, M, row pitch] fp32 (SPLIT_K > 1)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero between calls (SPLIT_K > 1)
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    stride_om,
    stride_osplit,
    BLOCK_M: tl.constexpr,  # 1, 2 or 4: one [BLOCK_N, BLOCK_K] accumulator a row, in the weight tile's layout
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # every slice is whole BLOCK_K steps: no masks on the weight loads
    GATED: tl.constexpr,  # one row, W = [gate; up] of 2N rows: out = silu(x @ gate^T) * (x @ up^T), no split-K
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows_n = tl.minimum(offs_n, N - 1)  # rows past N re-read the last one (never stored): unmasked loads
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn
    # Separate 2-D accumulators (not one [BLOCK_M, BLOCK_N, BLOCK_K]): the products then stay in the layout
    # the weight tile is loaded in, where a 3-D product moved every tile through shared memory.
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    up_rows = w_rows + N * stride_wn  # GATED: the up row of each gate row (acc1 holds its products)
    loop_start = k_start
    if USE_PDL:  # the first weight tile streams in while the kernel before ends (weights: pdl.py's contract)
        ks = k_start + offs_k
        w, w_up = _load_tiles(w_rows, up_rows, ks, k_end, EVEN_K, GATED)
        prologue(USE_PDL)
        acc0, acc1, acc2, acc3 = _add_tiles(
            w, w_up, x_ptr, ks, k_end, M, stride_xm, acc0, acc1, acc2, acc3, BLOCK_M, BLOCK_N, GATED
        )
        loop_start = k_start + BLOCK_K
    for k0 in range(loop_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        w, w_up = _load_tiles(w_rows, up_rows, ks, k_end, EVEN_K, GATED)
        acc0, acc1, acc2, acc3 = _add_tiles(
            w, w_up, x_ptr, ks, k_end, M, stride_xm, acc0, acc1, acc2, acc3, BLOCK_M, BLOCK_N, GATED
        )
    offs_m = tl.arange(0, BLOCK_M)
    y = tl.where(offs_m[:, None] == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if GATED:  # rounded to the output dtype first, as gate_up is before kernels/silu_mul.py: the same bits
        dtype = out_ptr.dtype.element_ty
        gate = tl.sum(acc0, axis=1).to(dtype).to(tl.float32)
        up = tl.sum(acc1, axis=1).to(dtype).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up)[None, :]
    if BLOCK_M > 1:
        y += tl.where(offs_m[:, None] == 1, tl.sum(acc1, axis=1)[None, :], 0.0)
    if BLOCK_M > 2:
        y += tl.where(offs_m[:, None] == 2, tl.sum(acc2, axis=1)[None, :], 0.0)
        y += tl.where(offs_m[:, None] == 3, tl.sum(acc3, axis=1)[None, :], 0.0)
    if HAS_BIAS:  # noqa: SIM102 (constexpr, then a runtime test)
        if pid_k == 0:  # once, in slice 0's partial
            y += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    out_offs = offs_m[:, None] * stride_om + offs_n[None, :]
    _store_split_k(y, out_ptr, partial_ptr, counter_ptr, out_offs, mask, pid_n, pid_k, stride_osplit, SPLIT_K)


def gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,  # [M, N], rows may be strided
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias in x's dtype."""
    m, width = x.shape
    n, k = weight.shape
    assert width == k, (tuple(x.shape), tuple(weight.shape))
    assert x.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous"
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1, (tuple(out.shape), out.stride())
    assert m <= MAX_ROWS, f"gemv takes at most {MAX_ROWS} rows, got {m}"
    if m == 0:
        return out
    block_n, block_k, warps, split = config or default_config(m, n, k)
    block_k = min(block_k, triton.next_power_of_2(k))
    num_tiles = triton.cdiv(n, block_n)
    split = split or split_k(num_tiles, k, 2 * block_k, _TARGET_PROGRAMS)
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty slice
    # The partials share out's offsets: rows `pitch` apart (a one-row out's row stride is meaningless).
    pitch = n if m == 1 else out.stride(0)
    assert pitch >= n, f"output rows overlap: {tuple(out.shape)} with strides {out.stride()}"
    partial, counters = split_k_buffers(out, split, num_tiles, pitch)
    _gemv_kernel[(num_tiles, split)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        partial,
        counters,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        m * pitch,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        HAS_BIAS=bias is not None,
        EVEN_K=k % k_per_split == 0,
        GATED=False,
        num_warps=warps,
        **pdl.launch(x.device),
    )
    return out


def gemv_silu_mul(
    x: torch.Tensor,  # [1, K]
    weight: torch.Tensor,  # [2 * I, K]: the gate rows, then the up rows (a fused gate_up projection)
    config: GemvConfig | None = None,
) -> torch.Tensor:  # [1, I]
    """silu(x @ gate^T) * (x @ up^T), equal bit for bit to kernels/silu_mul.py after `gemv`. For rows of at most
    one BLOCK_K step, one launch: each program reads a gate row and its up row, so the [1, 2I] projection never
    goes to memory. Elsewhere the two launches, which measured faster (H200, graph-timed with PDL,
    bench/results/pdl_h200x2_2026-11-28/): SmolLM2's 3072 x 576 took 3.04 µs in one launch against 5.18 in two,
    but the 8B shape's 28672 x 4096 took 56.86 against 54.71 (14336 x 4096, TP=2: 30.04 against 29.01)."""
    m, k = x.shape
    rows, width = weight.shape
    assert m == 1 and width == k and rows % 2 == 0, (tuple(x.shape), tuple(weight.shape))
    assert x.stride(1) == 1 and weight.stride(1) == 1, "rows must be contiguous"
    n = rows // 2
    block_n, block_k, warps, split = config or default_config(m, n, k)
    block_k = min(block_k, triton.next_power_of_2(k))
    num_tiles = triton.cdiv(n, block_n)
    if k > block_k or (split or split_k(2 * num_tiles, k, 2 * block_k, _TARGET_PROGRAMS)) > 1:
        return silu_mul(gemv(x, weight, config=config))
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(num_tiles, 1)](
        x,
        weight,
        weight,
        out,
        out,
        out,
        1,
        n,
        k,
        triton.cdiv(k, block_k) * block_k,
        x.stride(0),
        weight.stride(0),
        n,
        n,
        BLOCK_M=1,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=1,
        HAS_BIAS=False,
        EVEN_K=k % block_k == 0,
        GATED=True,
        num_warps=warps,
        **pdl.launch(x.device),
    )
    return out
